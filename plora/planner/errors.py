"""The planner's one error type."""


class PlannerError(ValueError):
    """A sweep that cannot be planned; the message is one line and names the culprit."""
