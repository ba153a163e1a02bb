"""Serving under tensor parallelism: rank 0 runs the HTTP server and the engine; every other rank runs
the same engine on its share of the model, step for step.

Before each step rank 0 sends the requests added and aborted since the last one. Every rank then
holds the same requests in the same order, schedules them the same way, and samples the same tokens
from the same gathered logits, so only these messages cross between ranks, never a token.
"""

import logging
from datetime import timedelta

import torch.distributed as dist

from kiln.errors import KilnError
from kiln.runtime.engine import Engine

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=365)
"""How long a follower waits for rank 0's next step: as long as the server may sit idle."""

Message = tuple
"""("add", request_id, prompt_token_ids, params, prompt) or ("abort", request_id)."""


def control_group() -> dist.ProcessGroup:
    """A gloo group for the step messages, its timeout the server's idle time, not a collective's.
    Every rank must call this, in the same order as its other group creations."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def apply(engine: Engine, message: Message) -> None:
    """Do to `engine` what rank 0 did to its own. A request rank 0 refused is refused here too."""
    if message[0] == "abort":
        engine.abort(message[1])
        return
    _, request_id, ids, params, prompt = message
    try:
        engine.add_request(ids, params, prompt, request_id=request_id)
    except Exception as e:  # noqa: BLE001 - rank 0 failed it too, and its abort follows
        if not isinstance(e, KilnError):
            logger.error("request %s failed to start on this rank", request_id, exc_info=e)
        engine.abort(request_id)


class StepFeed:
    """Rank 0's side: `publish` the messages applied since the last step, right before each step."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def publish(self, messages: list[Message], stop: bool = False) -> None:
        dist.broadcast_object_list([(messages, stop)], src=0, group=self.group)


def follow(engine: Engine, group: dist.ProcessGroup) -> None:
    """Ranks other than 0: apply rank 0's messages and step with it, until rank 0 stops."""
    logger.info("rank %d follows rank 0's engine", dist.get_rank())
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        messages, stop = box[0]
        if stop:
            return
        for message in messages:
            apply(engine, message)
        engine.step()
