"""Worker failures: reading what a failed worker reported, choosing the root cause, the report."""

from elastrun.supervise.failures.failure import ProcessFailure
from elastrun.supervise.failures.report import ChildFailedError, copy_root_cause_error_file

__all__ = ["ChildFailedError", "ProcessFailure", "copy_root_cause_error_file"]
