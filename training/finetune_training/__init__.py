"""The finetune-operator training runtime: FSDP2 fine-tuning on Ray Train.

Importing this package is cheap (no torch, no ray): heavy imports happen inside the functions that
need them, so the operator, the CLI and the tests can import the pure parts (config, metrics,
netprobe parsing, progress client) without a GPU stack.

Entry points:
- `python -m finetune_training --config FILE`: what the RayJob runs inside the Ray cluster.
- `finetune run FILE` (`finetune_training.cli`): the same training on this machine with embedded Ray.

See docs/training.md.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
