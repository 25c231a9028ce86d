"""Emulated-compute runs of the real engines (workers for `koala_ds.runtime.spawn.spawn`), for the tests
and benchmarks/engine_speedup*.py: a harness in tests/, not part of the installed package.

`megatron_worker` runs, on every pipeline rank, the jobs of a spec through the real
`koala_ds.megatron` forward_backward_func (megatron-core's forward_step / backward_step,
the Koala p2p layer, split backward) with `EmulatedStage` model chunks that sleep for a cost
profile's times. It returns the start and end time of every step on this rank
(`time.perf_counter`, CLOCK_MONOTONIC: comparable between processes of one machine), so the
caller can take the step time as (latest end - earliest start) over ranks.

A job: {"key": any, "schedule": Schedule.to_dict(), "costs": [[F, I, W] ms per virtual stage],
"warmup": 2, "steps": 10}; "stock": true runs DeepSpeed's own engine and 1F1B instead (DeepSpeed
only). The spec: {"jobs": [...], "timeout_s": 60, "hidden": 8, "seq": 2}.
"""
from __future__ import annotations

import os
import random
import resource
import statistics
import time

import torch

from koala_ds.profiler.emulate import EmulatedStage, calibrate


class _MegatronChunk(torch.nn.Module):
    """An `EmulatedStage` with what megatron-core's forward_step expects of a model chunk."""

    def __init__(self, config, stage: int, num_stages: int, costs, hidden: int):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = stage == 0
        self.post_process = stage == num_stages - 1
        self.stage = EmulatedStage(*costs, hidden=hidden)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0]
        self.input_tensor = tensor

    def forward(self, data=None):
        x = data if self.pre_process else self.input_tensor
        return self.stage(x)


def _loss_func(output):
    loss = output.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    data = next(data_iterator) if model.pre_process else None
    return model(data), _loss_func


def chunk_config(num_stages: int, hidden: int, p: int, v: int):
    """The TransformerConfig the emulated chunks (`_MegatronChunk`) of a p x v pipeline carry."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_stages, hidden_size=hidden, num_attention_heads=1,
                             use_cpu_initialization=True, pipeline_dtype=torch.float32, params_dtype=torch.float32,
                             pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v if v > 1 else None,
                             gradient_accumulation_fusion=False, deallocate_pipeline_outputs=False)


class _MegatronRunner:
    """One job on the Megatron path: the model chunks of this rank and the Koala forward_backward_func."""

    def __init__(self, job: dict, rank: int, hidden: int, seq: int, timeout_s: float):
        from koala_ds.core.ir import Schedule
        from koala_ds.megatron import get_forward_backward_func

        schedule = Schedule.from_dict(job["schedule"])
        p, v, m, S = schedule.p, schedule.v, schedule.m, schedule.num_stages
        config = chunk_config(S, hidden, p, v)
        self.chunks = [_MegatronChunk(config, s, S, job["costs"][s], hidden) for s in schedule.placement.stages_of(rank)]
        self.func = get_forward_backward_func(schedule, timeout_s=timeout_s)
        self.data = [torch.randn(seq, 1, hidden) for _ in range(m)]
        self.v, self.m, self.seq = v, m, seq

    def step(self) -> None:
        iters = [iter(self.data) for _ in self.chunks]
        for c in self.chunks:
            c.zero_grad(set_to_none=True)
        self.func(forward_step_func=_forward_step, data_iterator=iters if self.v > 1 else iters[0],
                  model=self.chunks if self.v > 1 else self.chunks[0], num_microbatches=self.m,
                  seq_length=self.seq, micro_batch_size=1)


def _user_s() -> float:
    """This process's CPU seconds in user mode (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def _round_robin(runners: list, warmup: int, steps: int) -> list[list[tuple[float, float]]]:
    """Step k of every job, then step k + 1 of every job, ...: load drifts hit all jobs alike.
    Each round runs the jobs in a new order (the same on every rank: a shuffle seeded by the
    round): on this 2-core machine a job's step time depends on the jobs run just before it
    (the same 1f1b job measured 67-98 ms at different places in one fixed order), so a fixed
    order would charge that to particular jobs."""
    import torch.distributed as dist

    times: list[list[tuple[float, ...]]] = [[] for _ in runners]
    order = list(range(len(runners)))
    for k in range(warmup + steps):
        random.Random(k).shuffle(order)
        for j in order:
            dist.barrier()
            u0, c0, t0 = _user_s(), time.process_time(), time.perf_counter()
            runners[j].step()
            times[j].append((t0, time.perf_counter(), c0, time.process_time(), u0, _user_s()))
    return times


def _call(ref: str, *args):
    import importlib

    module, func = ref.split(":")
    return getattr(importlib.import_module(module), func)(*args)


def run_jobs(rank: int, world: int, spec: dict, make_runner) -> list:
    """The jobs of `spec`, round-robin (see `_round_robin`); with spec["chooser"] ("module:func"),
    the calibration jobs run first, rank 0 calls `func(spec["chooser_args"], calibration step
    times)` for the jobs to run, and the calibration jobs run again with those jobs."""
    import torch.distributed as dist

    calibrate()
    warmup, steps = spec.get("warmup", 2), spec.get("steps", 10)
    calibration = list(spec.get("calibration", []))
    jobs = list(spec.get("jobs", []))
    out = {}
    if spec.get("chooser"):
        runners = [make_runner(job) for job in calibration]
        times = _round_robin(runners, warmup, steps)
        gathered = [None] * world
        dist.all_gather_object(gathered, [{"key": j["key"], "times": t} for j, t in zip(calibration, times)])
        chosen = [None]
        if rank == 0:
            chosen[0] = _call(spec["chooser"], spec.get("chooser_args"), step_times_ms(gathered, warmup))
        dist.broadcast_object_list(chosen, src=0)
        jobs = chosen[0]["jobs"]
        out["chooser"] = chosen[0]
        out["first_calibration"] = [{"key": j["key"], "times": t} for j, t in zip(calibration, times)]
        del runners
    all_jobs = calibration + jobs
    runners = [make_runner(job) for job in all_jobs]
    times = _round_robin(runners, warmup, steps)
    out["jobs"] = [{"key": j["key"], "times": t} for j, t in zip(all_jobs, times)]
    return out


def megatron_worker(rank: int, world: int, spec: dict):
    """See the module docstring; returns a list of {"key", "times"} (or `run_jobs`' dict with a chooser)."""
    from megatron.core import parallel_state as ps

    hidden, seq, timeout = spec.get("hidden", 8), spec.get("seq", 2), spec.get("timeout_s", 60)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
    try:
        if not spec.get("chooser") and not spec.get("calibration"):  # plain list of jobs
            runners = [_MegatronRunner(job, rank, hidden, seq, timeout) for job in spec["jobs"]]
            times = _round_robin(runners, spec.get("warmup", spec["jobs"][0].get("warmup", 2)),
                                 spec.get("steps", spec["jobs"][0].get("steps", 10)))
            return [{"key": j["key"], "times": t} for j, t in zip(spec["jobs"], times)]
        return run_jobs(rank, world, spec, lambda job: _MegatronRunner(job, rank, hidden, seq, timeout))
    finally:
        ps.destroy_model_parallel()


def step_times_ms(per_rank: list, warmup: int) -> list[list[float]]:
    """Per job: the step times (ms) after `warmup`, each = latest end - earliest start over ranks.
    `per_rank`: each rank's list of {"key", "times"} (or `run_jobs`' dict: its "jobs")."""
    per_rank = [r["jobs"] if isinstance(r, dict) else r for r in per_rank]
    jobs = []
    for j in range(len(per_rank[0])):
        times = [r[j]["times"] for r in per_rank]
        steps = []
        for k in range(warmup, len(times[0])):
            steps.append((max(t[k][1] for t in times) - min(t[k][0] for t in times)) * 1000.0)
        jobs.append(steps)
    return jobs


# -- DeepSpeed ------------------------------------------------------------------------------------
def cpu_ms_per_step(per_rank: list, warmup: int, user: bool = False) -> list[float]:
    """Per job: the CPU time (ms, all ranks together) of one step, median over the steps after
    `warmup` (time.process_time: this process's threads, gloo's included); with `user`, only
    the time in user mode (getrusage: the kernel's, such as waking a thread for a message, left out)."""
    per_rank = [r["jobs"] if isinstance(r, dict) else r for r in per_rank]
    out = []
    for j in range(len(per_rank[0])):
        steps = []
        for k in range(warmup, len(per_rank[0][j]["times"])):
            rows = [r[j]["times"][k] for r in per_rank]
            first = 4 if user else 2
            if any(len(t) < first + 2 for t in rows):
                break
            steps.append(sum(t[first + 1] - t[first] for t in rows) * 1000.0)
        out.append(statistics.median(steps) if steps else float("nan"))
    return out


def _mean_loss(outputs, labels):
    return outputs.float().mean()


class _DeepSpeedRunner:
    def __init__(self, job: dict, world: int, hidden: int, seq: int, timeout_s: float):
        import tempfile

        import deepspeed

        from koala_ds.deepspeed import KoalaPipelineModule
        from deepspeed_jobs import ds_config

        from koala_ds.core.ir import Schedule

        schedule = Schedule.from_dict(job["schedule"])
        p, v, m, S = schedule.p, schedule.v, schedule.m, schedule.num_stages
        layers = [EmulatedStage(*job["costs"][s], hidden=hidden) for s in range(S)]
        if job.get("stock"):  # DeepSpeed's own PipelineEngine and 1F1B TrainSchedule, for comparison
            from deepspeed.pipe import PipelineModule

            self.model = PipelineModule(layers, num_stages=p, loss_fn=_mean_loss, partition_method="uniform")
            config, path = ds_config(m, 1, world // p), None
        else:
            self.model = KoalaPipelineModule(layers, num_stages=p, chunks=v, placement=schedule.placement,
                                             loss_fn=_mean_loss, partition_method="uniform")
            fd, path = tempfile.mkstemp(prefix="koala-bench-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(schedule.to_json())
            config = ds_config(m, 1, world // p, koala={"schedule": path, "timeout_s": timeout_s}, schedule="koala")
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=config)
        if path is not None:
            os.unlink(path)
        self.data = [(torch.randn(1, seq, hidden), torch.zeros(1)) for _ in range(m)]

    def step(self) -> None:
        self.engine.train_batch(iter(self.data))


def deepspeed_worker(rank: int, world: int, spec: dict):
    """The same jobs through koala_ds.deepspeed's KoalaPipelineEngine (`engine.train_batch`, which
    also reduces gradients and steps the optimizer: a tiny cost here). Launch with
    `deepspeed_jobs.launch` (it sets up DeepSpeed on CPU)."""
    import logging

    import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    hidden, seq, timeout = spec.get("hidden", 8), spec.get("seq", 2), spec.get("timeout_s", 60)
    return run_jobs(rank, world, spec, lambda job: _DeepSpeedRunner(job, world, hidden, seq, timeout))


# -- the real GPT of examples/megatron_gpt ----------------------------------------------------------
def profile_gpt_worker(rank: int, world: int, spec: dict) -> dict:
    """`profile_megatron_gpt(**spec)` in a fresh process (one-rank process group); the profile dict."""
    from koala_ds.profiler.models import profile_megatron_gpt

    return profile_megatron_gpt(**spec).to_dict()


class _GPTRunner:
    """One job on the real GPT: megatron-core GPTModel chunks (local layer spec, fp32) for this rank."""

    def __init__(self, job: dict, rank: int, cfg: dict, timeout_s: float):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        from koala_ds.core.ir import Schedule
        from koala_ds.megatron import get_forward_backward_func

        schedule = Schedule.from_dict(job["schedule"])
        p, v, m, S = schedule.p, schedule.v, schedule.m, schedule.num_stages
        seq, mbs, vocab = cfg["seq_length"], cfg["micro_batch_size"], cfg["vocab_size"]
        config = TransformerConfig(num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
                                   num_attention_heads=cfg["num_attention_heads"], use_cpu_initialization=True,
                                   pipeline_dtype=torch.float32, params_dtype=torch.float32, hidden_dropout=0.0,
                                   attention_dropout=0.0, pipeline_model_parallel_size=p,
                                   virtual_pipeline_model_parallel_size=v if v > 1 else None,
                                   bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                   deallocate_pipeline_outputs=True)
        self.chunks = []
        for c, stage in enumerate(schedule.placement.stages_of(rank)):
            torch.manual_seed(1234 + stage)
            self.chunks.append(GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq,
                                        pre_process=stage == 0, post_process=stage == S - 1,
                                        share_embeddings_and_output_weights=False, vp_stage=c if v > 1 else None))
        g = torch.Generator().manual_seed(7)
        self.data = [(torch.randint(0, vocab, (mbs, seq), generator=g),
                      torch.randint(0, vocab, (mbs, seq), generator=g)) for _ in range(m)]
        pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril().logical_not()

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            output = model(tokens if model.pre_process else None, pos, mask,
                           labels=labels if model.post_process else None)
            return output, _loss_func

        self.forward_step = forward_step
        self.func = get_forward_backward_func(schedule, timeout_s=timeout_s)
        self.v, self.m, self.seq, self.mbs = v, m, seq, mbs

    def step(self) -> None:
        iters = [iter(self.data) for _ in self.chunks]
        for ch in self.chunks:
            ch.zero_grad(set_to_none=True)
        self.func(forward_step_func=self.forward_step, data_iterator=iters if self.v > 1 else iters[0],
                  model=self.chunks if self.v > 1 else self.chunks[0], num_microbatches=self.m,
                  seq_length=self.seq, micro_batch_size=self.mbs)


def megatron_gpt_worker(rank: int, world: int, spec: dict) -> list:
    """Jobs (as for `megatron_worker`, without "costs") on the real GPT, round-robin. spec["model"]:
    num_layers, hidden_size, num_attention_heads, seq_length, micro_batch_size, vocab_size."""
    from megatron.core import parallel_state as ps

    from koala_ds.megatron.cpu import prepare_cpu

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
    prepare_cpu(seed=1234)
    try:
        runners = [_GPTRunner(job, rank, spec["model"], spec.get("timeout_s", 120)) for job in spec["jobs"]]
        times = _round_robin(runners, spec.get("warmup", 2), spec.get("steps", 10))
        return [{"key": j["key"], "times": t} for j, t in zip(spec["jobs"], times)]
    finally:
        ps.destroy_model_parallel()


# -- the plain-torch GPT on DeepSpeed -----------------------------------------------------------------
def _lm_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def profile_deepspeed_gpt_worker(rank: int, world: int, spec: dict) -> dict:
    """The plain-torch GPT (`models.gpt_layer_specs`) profiled as a DeepSpeed layer list would be
    partitioned into spec["stages"] virtual stages (uniform), in a fresh process; the profile dict."""
    from koala_ds.profiler.models import gpt_layer_specs, profile_pipeline_module

    cfg = spec["model"]
    specs = gpt_layer_specs(cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["seq_length"],
                            cfg["vocab_size"])
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg["vocab_size"], (cfg["micro_batch_size"], cfg["seq_length"]), generator=g)
    labels = torch.randint(0, cfg["vocab_size"], (cfg["micro_batch_size"], cfg["seq_length"]), generator=g)
    torch.manual_seed(1234)
    result = profile_pipeline_module(specs, ids, spec["stages"], partition_method="uniform",
                                     loss_fn=lambda out: _lm_loss(out, labels), warmup=spec.get("warmup", 2),
                                     iters=spec.get("iters", 10), p2p=False)
    return result.to_dict()


class _DeepSpeedGPTRunner:
    """One job on the plain-torch GPT through KoalaPipelineEngine (train_batch: also the gradient
    reduction and an SGD step with lr 0)."""

    def __init__(self, job: dict, world: int, cfg: dict, timeout_s: float):
        import tempfile

        import deepspeed

        from koala_ds.deepspeed import KoalaPipelineModule
        from deepspeed_jobs import ds_config

        from koala_ds.core.ir import Schedule
        from koala_ds.profiler.models import gpt_layer_specs

        schedule = Schedule.from_dict(job["schedule"])
        p, v, m = schedule.p, schedule.v, schedule.m
        torch.manual_seed(1234)
        specs = gpt_layer_specs(cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["seq_length"],
                                cfg["vocab_size"])
        self.model = KoalaPipelineModule(specs, num_stages=p, chunks=v, placement=schedule.placement,
                                         loss_fn=_lm_loss, partition_method="uniform")
        fd, path = tempfile.mkstemp(prefix="koala-bench-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(schedule.to_json())
        config = ds_config(m, cfg["micro_batch_size"], world // p, koala={"schedule": path, "timeout_s": timeout_s},
                           schedule="koala")
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=config)
        os.unlink(path)
        g = torch.Generator().manual_seed(7)
        shape = (cfg["micro_batch_size"], cfg["seq_length"])
        self.data = [(torch.randint(0, cfg["vocab_size"], shape, generator=g),
                      torch.randint(0, cfg["vocab_size"], shape, generator=g)) for _ in range(m)]

    def step(self) -> None:
        self.engine.train_batch(iter(self.data))


def deepspeed_gpt_worker(rank: int, world: int, spec: dict) -> list:
    """Jobs (as for `megatron_gpt_worker`) on the plain-torch GPT through koala_ds.deepspeed,
    round-robin. Launch with `deepspeed_jobs.launch`."""
    import logging

    import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    runners = [_DeepSpeedGPTRunner(job, world, spec["model"], spec.get("timeout_s", 120)) for job in spec["jobs"]]
    times = _round_robin(runners, spec.get("warmup", 2), spec.get("steps", 10))
    return [{"key": j["key"], "times": t} for j, t in zip(spec["jobs"], times)]
