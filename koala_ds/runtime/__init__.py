"""The runtime pieces every engine adapter shares (torch only, below the adapters, above the core):
the lowering of a schedule to per-rank compute + SEND / RECV (`lowering`), a process group per
channel (`channels`), deadlines (`timeout`, `bounded_collectives`), the split backward and its
hold policy (`wgrad`, `wgrad_policy`, `_wgrad_megatron`), the measured-trace recorder
(`trace_record`) and the process helpers (`spawn`, `torchrun`: koala-run). Modules that need torch
import it themselves: `lowering`, `timeout`, `trace_record` and `wgrad_policy` are plain Python."""
