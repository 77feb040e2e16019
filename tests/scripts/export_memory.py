"""Child process of the export peak-memory test: ``export_memory.py CHECKPOINT OUT_DIR MODEL_DIR {streaming,whole}``.

Imports everything the export uses first, then runs ``lightning-plugins export`` in this process and prints
one JSON line: the growth of the peak resident set (``VmHWM`` of ``/proc/self/status``, which counts every
page of tensor storage the process ever touched) over the export. ``whole`` first loads every weight of
the checkpoint at once (what a non-streaming export does), so the test can show that the measure sees it.
"""

from __future__ import annotations

import json
import sys


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    checkpoint, out_dir, model_dir, mode = sys.argv[1:5]
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401  (the meta model the export builds)

    import lightning_plugins.checkpoint.export as export
    from lightning_plugins.cli import main as cli

    if mode == "whole":
        streaming, held = export._stream, []

        def whole(reader, tensors, keys):  # noqa: ANN001, ANN202
            if not held:  # every weight of the checkpoint, kept to the end (the output is the same)
                held.append(export._load(reader, tensors, [key for key in tensors if key.startswith("state_dict.")]))
            yield from streaming(reader, tensors, keys)

        export._stream = whole
    before = _kib("VmHWM")
    cli(["export", checkpoint, out_dir, "--model", model_dir, "--max-shard-size", "100MB"])
    print(json.dumps({"before_kib": before, "peak_kib": _kib("VmHWM")}))


if __name__ == "__main__":
    main()
