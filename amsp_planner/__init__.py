"""amsp-planner: sharding-strategy planner for ZeRO-style LLM training.

    amsp compare --model llama-7b --gpus 1024
"""

__version__ = "0.1.0"
