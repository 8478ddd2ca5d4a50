"""The Ray side of raypar: the trainer, its controller and what they decide, record and show.

Only this package (and `raypar.actors`) imports Ray; the rest of `raypar/` is plain
libraries the workers and tests use without a cluster.
"""
from raypar.driver.callbacks import Callback
from raypar.driver.records import Recovery, RunSummary, StepRecord
from raypar.driver.saver import SaveResult
from raypar.driver.trainer import Trainer

__all__ = ["Callback", "Recovery", "RunSummary", "SaveResult", "StepRecord", "Trainer"]
