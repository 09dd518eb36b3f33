"""Request state, KV block bookkeeping and the continuous-batching scheduler. Standard library only."""

from .block_pool import BlockPool
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus, finish_reason
from .scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "finish_reason",
]
