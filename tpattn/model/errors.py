"""The errors of the cost model and of python -m tpattn.plan, and its exit statuses: below every
other module of tpattn.model, so each can raise them without an import circle."""

EXIT_FAIL, EXIT_USAGE = 1, 2


class MachineError(ValueError):
    """A machine description that cannot be used: the message is one line that names the fix."""


class ModelError(ValueError):
    """A prediction the machine description cannot make (a missing calibration, no network)."""


class PlanError(ValueError):
    """A bad input: one line that names the fix (exit 2)."""
