"""A follower rank of a data parallel learner (torchrun rank > 0): no broker, no files.

It builds the same policy and optimizer as rank 0 and trains its share of every step rank 0
broadcasts, until rank 0 stops (see :mod:`.distributed`).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from rlbus.learner.settings import LearnerSettings
from rlbus.runner import configure_logging
from rlbus.settings import UnknownSettingError

log = logging.getLogger(__name__)


def follow() -> None:
    try:
        settings = LearnerSettings()
    except (ValidationError, UnknownSettingError) as exc:
        raise SystemExit(f"rlbus learner (follower rank): invalid settings:\n{exc}") from None
    configure_logging(settings.log_level)
    from rlbus.learner.trainer import Trainer

    trainer = Trainer(settings)
    try:
        steps = trainer.follow()
    finally:
        trainer.world.close()
    log.info("follower rank %d: %d steps, released by rank 0", trainer.world.rank, steps)
