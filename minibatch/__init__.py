"""minibatch: a compact LLM inference engine and a course on dynamic batching.

The offline API follows vLLM's::

    from minibatch import LLM, SamplingParams
    llm = LLM(model="tiny", max_num_seqs=16, policy="continuous")
    outs = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.llm import LLM
from minibatch.model.loader import tiny_model_path
from minibatch.request import CompletionOutput, RequestMetrics, RequestOutput, RequestStatus
from minibatch.sampling_params import SamplingParams

TINY_MODEL_PATH = tiny_model_path()

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "RequestStatus", "TINY_MODEL_PATH"]
__version__ = "0.1.0"
