"""Springback for the trainers people already use: Hugging Face ``Trainer``
(`springback.integrations.hf`) and Lightning (`springback.integrations.lightning`).

It runs in restart mode (``springback run -- python train.py``): on every
generation the agent restarts the script's ranks with torchrun's environment,
and the integration connects the trainer's checkpoints, drains and progress to
Springback: it resumes from the newest checkpoint committed under the job's
``checkpoint.uri`` (``springback.storage.resume``), saves a drain checkpoint
when the ranks are told to stop (SIGTERM, the agent's drain marker), records
every save as a commit through the agent, and reports steps and loss. The
recipes and their guarantees are in docs/trainers.md.

This package sits at the training-library layer: it may import
`springback.worker`, `springback.storage` and `springback.client`; nothing but
the CLI imports it. The trainer itself is an optional extra
(``springback[hf]``, ``springback[lightning]``), imported only by the module that needs it.
"""

from springback.integrations.data import per_rank_batch_size
from springback.integrations.drain import DRAINED_EXIT_CODE, DrainWatch

__all__ = ["DRAINED_EXIT_CODE", "DrainWatch", "per_rank_batch_size"]
