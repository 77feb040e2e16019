"""Preference fine-tuning: DPO (sigmoid, robust, IPO), SimPO, ORPO and KTO's losses as TRL defines them, each
sequence's log-probability through the engine's loss path (chunked, vocab-sharded), and the objective the doors call.

* :mod:`~lightning_plugins.preference.losses`: the losses on sequence log-probabilities (pure torch).
* :mod:`~lightning_plugins.preference.logps`: :func:`sequence_logps`, summed per row without full logits.
* :mod:`~lightning_plugins.preference.objective`: :class:`PreferenceObjective`: a batch of pairs to its loss and
  TRL's metrics, the reference being the base model with the adapters disabled.
* :mod:`~lightning_plugins.preference.options`: :class:`PreferenceOptions`, the recipe's ``objective:`` section.
* :mod:`~lightning_plugins.preference.kto`: :class:`KTOObjective`: KTO on unpaired examples and their KL rows.
* :mod:`~lightning_plugins.preference.reference`: a full fine-tune's frozen reference, sharded like the policy.
* :mod:`~lightning_plugins.preference.pipeline`: the paired methods on a model split into pipeline stages (each pair
  in one pipeline micro-batch, its loss on the last stage).

Framework-free (no Lightning, no Accelerate): both doors, and a user's own ``training_step``, call it.
"""

from lightning_plugins.preference.logps import SequenceLogps, sequence_logps
from lightning_plugins.preference.kto import KTOObjective
from lightning_plugins.preference.objective import PreferenceObjective
from lightning_plugins.preference.options import PreferenceOptions

__all__ = ["KTOObjective", "PreferenceObjective", "PreferenceOptions", "SequenceLogps", "sequence_logps"]
