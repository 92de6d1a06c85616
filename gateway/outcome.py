"""How a request ended, as the `x-spillgate-outcome` header and metrics name it."""

from enum import StrEnum


class Outcome(StrEnum):
    LOCAL = "local"
    QUEUED = "queued"
    DEGRADED = "degraded"
    PROVIDER = "provider"
    CACHED = "cached"
    THROTTLED = "throttled"
    REJECTED = "rejected"
    ERROR = "error"


OUTCOME_HEADER = "x-spillgate-outcome"
# the header as a response carries it, one per outcome, made once
OUTCOME_HEADERS = {o: (OUTCOME_HEADER.encode(), o.value.encode()) for o in Outcome}
