"""Static-batching scheduler (core_r0.8.0's `Scheduler`): three ordered pools of requests.

Requests become active in arrival order while fewer than `max_batch_size` are active; the rest
wait. After each batch, completed requests move to the completed pool and the active pool is
refilled from the waiting one (FIFO).
"""

import time
from collections import OrderedDict
from typing import Dict, List, Optional

from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.utils import Counter


class Scheduler:
    """Pools of active, waiting and completed requests, keyed by request id (a str).

    Args:
        max_batch_size (int): most requests active at once.
    """

    def __init__(self, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.active_request_pool: Dict[str, InferenceRequest] = OrderedDict()
        self.waiting_request_pool: Dict[str, InferenceRequest] = OrderedDict()
        self.completed_request_pool: Dict[str, InferenceRequest] = OrderedDict()
        self.request_counter = Counter()

    def add_request(
        self,
        prompt: str,
        prompt_tokens: List[int],
        inference_parameters: SamplingParams,
        arrival_time: Optional[float] = None,
    ) -> str:
        """Add a request: active if there is room, else waiting. Returns its id."""
        request_id = str(next(self.request_counter))
        if arrival_time is None:
            arrival_time = time.time()
        has_room = len(self.active_request_pool) < self.max_batch_size
        status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS if has_room else Status.WAITING_IN_QUEUE
        pool = self.active_request_pool if has_room else self.waiting_request_pool
        pool[request_id] = InferenceRequest(
            request_id=request_id,
            status=status,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            inference_parameters=inference_parameters,
            arrival_time=arrival_time,
        )
        return request_id

    def have_requests_pending(self) -> bool:
        """Whether any request is active or waiting."""
        return len(self.active_request_pool) + len(self.waiting_request_pool) > 0

    def add_earliest_waiting_request_to_active_pool(self) -> None:
        """Move the oldest waiting request to the active pool."""
        assert len(self.active_request_pool) < self.max_batch_size, (
            "Active request pool is already full. Cant add any more requests"
        )
        if len(self.waiting_request_pool) > 0:
            request_id, request = self.waiting_request_pool.popitem(last=False)
            request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            self.active_request_pool[request_id] = request

    def update_requests_pools(self, result_dict: Optional[Dict[str, InferenceRequest]] = None):
        """Move the COMPLETED requests of `result_dict` from active to completed, then refill the
        active pool from the waiting one."""
        # A snapshot of the ids: `result_dict` may be the active pool itself (as when a caller
        # passes scheduler.active_request_pool back), which this loop shrinks.
        for request_id in list(result_dict or {}):
            request = self.active_request_pool.get(request_id, result_dict[request_id])
            if request.status == Status.COMPLETED:
                self.active_request_pool.pop(request_id, None)
                self.completed_request_pool[request_id] = request
        while (
            len(self.active_request_pool) < self.max_batch_size
            and len(self.waiting_request_pool) > 0
        ):
            self.add_earliest_waiting_request_to_active_pool()
