"""Pipeline schedules as data: generate per-stage programs, lower them, simulate them."""
from raypar.schedule.generators import SCHEDULES, forward_then_backward, get_schedule, one_f_one_b
from raypar.schedule.ir import Action, Op, ScheduleError, comm_groups, format_program, parse_program
from raypar.schedule.lower import build_programs, lower
from raypar.schedule.simulator import Prepared, SimResult, prepare, simulate, validate

__all__ = [
    "SCHEDULES",
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
