"""The prologue of a child process in which importing Triton fails: prepend it to the child's code
(`python -c BLOCK_TRITON + code`). torch's lazy CUDA start (2.11) imports Triton itself, so CUDA is
started first where there is a GPU, then every Triton module is dropped and later imports refused:
what runs after it proves a path needs no compiler."""

BLOCK_TRITON = """
import sys
import torch
if torch.cuda.is_available():
    torch.cuda.init()
for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
    del sys.modules[name]
class BlockTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"{name} is blocked: this path must not import Triton")
sys.meta_path.insert(0, BlockTriton())
"""
