"""Run a door's command with the disk filling up on one rank in the middle of one checkpoint (tests only).

    python disk_full.py RANK STEP lightning finetune RECIPE [--a.b=v ...]       (Lightning re-runs it per rank)
    accelerate launch ... disk_full.py RANK STEP accelerate RECIPE [--a.b=v ...]

On global rank ``RANK``, writing a DCP data file of the checkpoint of step ``STEP`` raises
``OSError(ENOSPC)`` after its first bytes, as a full disk does. The patch sits on the stream every checkpoint file is
written through (:class:`lightning_plugins.checkpoint.integrity._HashingStream`); the library holds no test hook.
"""

from __future__ import annotations

import errno
import os
import sys

import torch.distributed as dist


def main() -> None:
    rank, step, door, *argv = sys.argv[1:]
    from lightning_plugins.checkpoint import integrity

    write = integrity._HashingStream.write

    def full_disk(self: integrity._HashingStream, data: object) -> int:
        name = getattr(self.raw, "name", "")
        if (
            dist.get_rank() == int(rank)
            and f"step={step}.ckpt.partial" in name
            and name.endswith(".distcp")
            and self.size > 0
        ):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)

    integrity._HashingStream.write = full_disk  # type: ignore[method-assign]
    if door == "lightning":
        from lightning_plugins.cli import main as lightning_main

        lightning_main(argv)
    else:
        from lightning_plugins.accelerate.__main__ import main as accelerate_main

        accelerate_main(argv)


if __name__ == "__main__":
    main()
