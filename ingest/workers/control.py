"""Follows `rollout.control` for one run: step seals, demands and new weights reach the loop.

The consumer is positioned at the end of every partition before the worker issues its
first group: seals of earlier worker runs are history, the ones that matter come later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import orjson
from kafka.errors import AuthorizationError, KafkaError
from pydantic import ValidationError

from ingest.io.kafka import PUBLISHERS, KafkaSettings, PartitionReader, not_authorized
from schemas.control import CONTROL_MODELS, Demand, StepSealed, WeightsUpdated
from schemas.errors import BrokerUnavailableError, RolloutlakeError

log = logging.getLogger(__name__)

POLL_MS = 100
FOLLOWED = ("step_sealed", "demand", "weights_updated")
Followed = StepSealed | Demand | WeightsUpdated


class ControlFollower:
    """Calls `on_message(message)` from its own thread for each `step_sealed`, `demand`
    and `weights_updated` of `run_id`, and `on_error(error)` once if it cannot follow on:
    a worker deaf to seals would never cancel, nor issue what a demand asks for."""

    def __init__(self, settings: KafkaSettings, run_id: str,
                 on_message: Callable[[Followed], object],
                 on_error: Callable[[RolloutlakeError], object]):
        self.settings = settings
        self.run_id = run_id
        self.on_message = on_message
        self.on_error = on_error
        # A stalled fetch would leave the loop deaf to seals: it would never cancel.
        self._reader = PartitionReader(settings, [settings.topics.control], what="control "
                                       "follower", from_end=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="control-follower",
                                        daemon=True)

    def start(self) -> ControlFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._reader.close()

    def _follow(self) -> None:
        try:
            while not self._stop.is_set():
                for records in self._reader.poll(timeout_ms=POLL_MS).values():
                    for record in records:
                        message = self._followed(record.value)
                        if message is not None:
                            self.on_message(message)
        except AuthorizationError as err:
            self.on_error(not_authorized(self.settings, err, PUBLISHERS))
        except KafkaError as err:
            self.on_error(BrokerUnavailableError(
                f"cannot follow {self.settings.topics.control}: {type(err).__name__}: {err}"))

    def _followed(self, value: bytes | None) -> Followed | None:
        try:
            body = orjson.loads(value or b"null")
            if not isinstance(body, dict) or body.get("type") not in FOLLOWED:
                return None
            message = CONTROL_MODELS[body["type"]].model_validate(body)
        except (orjson.JSONDecodeError, ValidationError) as err:
            log.warning("ignoring an unreadable rollout.control message: %s", err)
            return None
        if message.run_id != self.run_id:
            return None
        assert isinstance(message, Followed)
        return message
