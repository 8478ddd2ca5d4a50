"""tests/tolerances.py: a run that only sums in another order passes; real errors fail.

The run here is a second reference that accumulates micro-batches, as a pipeline does,
with the equivalence tests' learning rate, dropout and clipping, all in one process.
"""
import pytest

from raypar.data import SampleOrder
from raypar.kernels import sample_seeds
from raypar.reference import ReferenceTrainer

from helpers import assert_same, synthetic_data, tiny_config
from tolerances import Tolerances

MICROBATCHES = 4


def microbatched_step(trainer: ReferenceTrainer, step, tokens, labels, ids, skip=None):
    """One optimizer step over MICROBATCHES backwards; micro-batch `skip` left out, as a bug would."""
    size = len(ids) // MICROBATCHES
    for k in range(MICROBATCHES):
        if k != skip:
            part = slice(k * size, (k + 1) * size)
            seeds = sample_seeds(trainer.cfg.train.seed, step, ids[part])
            (trainer.model(tokens[part], labels[part], seeds) / MICROBATCHES).backward()
    grads = {n: g.clone() for n, g in trainer.optimizer.named_grads().items()}
    norm = float(trainer.optimizer.local_sq_norm().sqrt())
    trainer.optimizer.step(step, norm)
    return grads, norm


def run_next_to_reference(tmp_path, skip_at=None):
    cfg = tiny_config(tmp_path, model={"dropout": 0.2}, train={"global_batch_size": 16})
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    ref, run = ReferenceTrainer(cfg), ReferenceTrainer(cfg)
    tol = Tolerances(ref)
    for step in range(cfg.train.steps):
        ids = order.indices(step * 16, 16)
        tokens, labels = dataset.get(ids)
        grads, norm = microbatched_step(run, step, tokens, labels, ids, skip=1 if step == skip_at else None)
        ref_loss, ref_grads = ref.step(step, tokens, labels, sample_ids=ids)
        tol.observe(step, tokens, labels, ids, ref_loss, ref_grads, [norm])
        assert_same(grads, ref_grads, tol.grads, f"step {step}")
        tol.check_weights(run.parameters(), ref.parameters(), f"step {step}")
    return tol, ref


def test_micro_batch_accumulation_stays_within_bounds(tmp_path):
    run_next_to_reference(tmp_path)


def test_a_dropped_micro_batch_fails(tmp_path):
    with pytest.raises(AssertionError, match="step 2 .* out of bounds"):
        run_next_to_reference(tmp_path, skip_at=2)


def test_any_weight_tensor_off_by_a_relative_1e_3_fails(tmp_path):
    # After the last step, where the bounds have grown the most.
    tol, ref = run_next_to_reference(tmp_path)
    want = ref.parameters()
    for name, w in want.items():
        with pytest.raises(AssertionError, match=f"weights {name}"):
            assert_same({**want, name: w * (1 + 1e-3)}, want, tol.weights, "off: weights")
