"""minibatch: a compact LLM inference engine and a course on dynamic batching.

The offline API follows vLLM's::

    from minibatch import LLM, SamplingParams
    llm = LLM(model="tiny", max_num_seqs=16, policy="continuous")
    outs = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

import os

# OpenMP threads that spin while waiting make every torch op dozens of times slower as
# soon as another busy process shares the cores (a notebook kernel beside a server, a
# test run beside a build). Passive waiting costs little when the machine is idle.
# It only takes effect if torch has not been imported yet; set it yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from minibatch.config import EngineConfig  # noqa: E402
from minibatch.engine import LLMEngine  # noqa: E402
from minibatch.llm import LLM  # noqa: E402
from minibatch.model.loader import tiny_model_path  # noqa: E402
from minibatch.request import CompletionOutput, RequestMetrics, RequestOutput, RequestStatus  # noqa: E402
from minibatch.results import RequestRecord, RunResult  # noqa: E402
from minibatch.runner import RunController, run  # noqa: E402
from minibatch.sampling_params import SamplingParams  # noqa: E402

TINY_MODEL_PATH = tiny_model_path()

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "RequestStatus", "TINY_MODEL_PATH", "run", "RunResult", "RunController",
           "RequestRecord"]
__version__ = "0.1.0"
