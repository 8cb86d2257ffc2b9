"""`python -m tests.fsdp_on_cpu MODULE ARGS...`: run MODULE as __main__ with accelerate's FSDP on CPU processes.

accelerate 1.16 never runs FSDP on CPU processes: with ACCELERATE_USE_CPU its state is MULTI_CPU and
`prepare` wraps models in DDP, whatever the FSDP plugin says (accelerate/state.py decides the distributed
type from the device before it looks at FSDP). torch's FSDP2 itself runs on gloo. This makes the state FSDP
once accelerate has set it up, so that the code a GPU run takes (accelerate's fully_shard wrapping, sharded
save_state / load_state, the full state dict gathered for export, our trainer around them) runs here.
Launched under `accelerate launch` as the module it runs, never imported by stem_upcycle."""

import runpy
import sys

import accelerate.state as state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # both states: AcceleratorState copies PartialState's shared state each time it is built
        self.distributed_type = state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


state.AcceleratorState.__init__ = _fsdp_on_cpu
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
