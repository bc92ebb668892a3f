"""Run in the SGLang environment: SGLang's argument resolution with KVzap's plugin loaded, CUDA's default graph
settings on this CPU machine (``default_prefill_backend`` answering as on CUDA: breakable prefill graphs), and prints
the prefill and decode graph backends it resolved, with the plugin's log lines, as JSON; also whether the model
runner's binding of ``should_run_flashinfer_autotune`` is a hook's wrapper (ragged mode skips SGLang's autotune).

    python graph_defaults_script.py BUNDLE MODEL MODE [PREFILL_BACKEND]
"""

import io
import json
import logging
import os
import sys

bundle, model, mode = sys.argv[1:4]
os.environ.update(KVZAP_BUNDLE=bundle, KVZAP_MODE=mode, SGLANG_USE_CPU_ENGINE="1")
lines = io.StringIO()
logging.basicConfig(level=logging.INFO, stream=lines)

from sglang.srt.model_executor import cuda_graph_config  # noqa: E402

cuda_graph_config.default_prefill_backend = lambda: cuda_graph_config.Backend.BREAKABLE  # SGLang's default on CUDA
from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

load_plugins()
kwargs = {"model_path": model, "device": "cpu", "skip_tokenizer_init": True}
if len(sys.argv) > 4:
    kwargs["cuda_graph_backend_prefill"] = sys.argv[4]
args = ServerArgs(**kwargs)
args.resolve_once()
graphs = resolved_view(args).cuda_graph_config
from sglang.srt.model_executor.runner import base_runner  # noqa: E402

hooked = getattr(base_runner.should_run_flashinfer_autotune, "__wrapped__", None) is not None
print(json.dumps({"prefill": graphs.prefill.backend, "decode": graphs.decode.backend, "autotune_hooked": hooked,
                  "log": [line for line in lines.getvalue().splitlines() if "kvzap" in line.lower()]}))
