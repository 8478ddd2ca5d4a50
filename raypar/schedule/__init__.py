"""Pipeline schedules as data: generate per-stage programs, lower them, simulate them."""
from raypar.schedule.generators import (CHUNKED_SCHEDULES, SCHEDULE_NAMES, SCHEDULES, compute_orders,
                                        forward_then_backward, get_schedule, one_f_one_b, run_layout,
                                        schedule_fits, schedule_layout)
from raypar.schedule.ir import Action, Op, ScheduleError, comm_groups, format_program, parse_program
from raypar.schedule.layout import Layout
from raypar.schedule.lower import build_programs, lower
from raypar.schedule.simulator import Prepared, SimResult, prepare, simulate, validate

__all__ = [
    "CHUNKED_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "Layout",
    "compute_orders",
    "run_layout",
    "schedule_fits",
    "schedule_layout",
    "Action",
    "Op",
    "ScheduleError",
    "Prepared",
    "SimResult",
    "build_programs",
    "comm_groups",
    "format_program",
    "forward_then_backward",
    "get_schedule",
    "lower",
    "one_f_one_b",
    "parse_program",
    "prepare",
    "simulate",
    "validate",
]
