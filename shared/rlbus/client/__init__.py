"""rlbus for a trainer of any framework: submit groups, receive scored groups, publish
weights. rlbus's own learner uses this client for all three.

Delivery contract: exactly once by checkpointed :class:`Position`. Every scored episode of
every group submitted reaches the trainer once, in a complete group, duplicates dropped;
a trainer that saves :meth:`RolloutClient.position` with a model that has trained on every
group received before it, and starts its next client from it, gets nothing twice and
loses nothing. Weights are announced only once written and checked.

API (async; :class:`SyncRolloutClient` has the same calls, blocking)::

    client = await RolloutClient.connect(ClientSettings(...), position=None)
    client.credit() -> int                 # training groups the credit window admits now
    await client.submit(task, spec, *, group_size, sampling=None, purpose="train",
                        group_id=None, eval_round=None, wait_s=0.0) -> Prompt
    await client.receive(n=None, *, timeout_s=None) -> list[ScoredGroup]   # training groups
    await client.evaluations(timeout_s=0.0) -> list[ScoredGroup]            # eval groups
    client.position() -> Position          # save it next to the model; .to_json()
    await client.commit(position)          # Kafka's committed offsets follow a saved one
    await client.publish_weights(weights, *, step=None, samples_trained=0,
                                 samples_masked=None, wait_served=False,
                                 timeout_s=120.0, min_members=1) -> WeightVersion
    await client.wait_served(version=None, *, timeout_s=120.0, min_members=1) -> Served
    await client.close()

* :class:`ScoredGroup`: ``group_id``, ``task``, ``purpose``, ``started`` and
  ``episodes``, each an :class:`Episode`: ``episode_id`` (for ``rlbus trace``),
  ``segments`` (each a :class:`Segment`: ``token_ids``, ``loss_mask``, ``logprobs``
  (behaviour, 0.0 off the mask); one for a linear episode, several where a gateway agent's
  history was not linear), ``reward``, ``policy_version``, ``finish_reason``, ``valid``,
  and the whole ``scored`` record. ``Episode.token_ids``/``loss_mask``/``logprobs`` are the
  one segment's; with several they raise :class:`~rlbus.errors.SegmentedEpisodeError`.
* Staleness: training groups are admitted while ``submitted < (max_staleness + steps + 1)
  * groups_per_step`` (``steps``: versions published); beyond, ``submit`` waits up to
  ``wait_s`` and raises :class:`~rlbus.errors.NoCreditError`. ``receive`` hands out the
  groups at their last chance within ``max_staleness`` first and waits for a straggler
  whose last chance is the next step (up to ``straggler_wait_s``).
* Backpressure: records are read from Kafka only inside ``receive``/``evaluations``, and
  only until the call can be answered.
* Errors: unknown task at submit, :class:`~rlbus.errors.PluginError`; weights of other
  names, shapes or dtypes than the previous version (or the served model folder),
  :class:`~rlbus.errors.WeightsMismatchError`, nothing written or announced; not served in
  time, :class:`~rlbus.errors.NotServedError`; refused by a member,
  :class:`~rlbus.errors.WeightsRefusedError`; a position of another topic or format,
  :class:`~rlbus.errors.PositionError`.
* Served: each inference member reports the version it serves on weights.served; a member
  is live while its newest report is younger than ``served_ttl_s`` (:mod:`.served`).
"""

from rlbus.client.groups import Episode, ScoredGroup, Segment
from rlbus.client.position import Position
from rlbus.client.rollout_client import RolloutClient, credit
from rlbus.client.served import Served
from rlbus.client.settings import ClientSettings
from rlbus.client.sync import SyncRolloutClient
from rlbus.errors import (
    NoCreditError,
    NotServedError,
    PluginError,
    PositionError,
    SegmentedEpisodeError,
    WeightsMismatchError,
    WeightsRefusedError,
)

__all__ = [
    "ClientSettings",
    "Episode",
    "NoCreditError",
    "NotServedError",
    "PluginError",
    "Position",
    "PositionError",
    "RolloutClient",
    "ScoredGroup",
    "Segment",
    "SegmentedEpisodeError",
    "Served",
    "SyncRolloutClient",
    "WeightsMismatchError",
    "WeightsRefusedError",
    "credit",
]
