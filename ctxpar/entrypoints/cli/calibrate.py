"""Measure this machine (attention FLOP/s in fp32 and bf16, each through the kernel
the engine runs: bf16 on AMX-BF16's tiles where the CPU has them; for each weight
dtype, fp32, bf16 and, on a CPU, q4 (GGUF's Q4_0 blocks), the FLOP/s of the engine's
projection at a prefill's rows and the rate its decode projection reads weights
(on a CPU both over a Llama-3.2-1B layer and a Llama-3-8B layer: `ctxpar estimate`
prices a model at the rates of the nearest width); memory read bandwidth; on a CPU
the rate the engine's paged decode kernel reads an fp32 and a bf16 KV cache (what
a decode step's KV read is priced at), and the rate a prefill's elementwise steps
move their values in each dtype over both layers (RMSNorms, residual adds, rope,
SiLU·up, the KV cache's write); all-gather latency and bandwidth between
two local ranks over gloo and shared memory; and the host's cost of a decode step
beyond its kernels, a step and a layer) and save a hardware profile for `ctxpar
estimate --hardware PATH`. Takes about a minute; one line per measurement. The
profile's rates are for ``--dtype``; the other dtypes' stay in its ``rates``, where
`ctxpar estimate` takes them for a model stored so (a Q4_0 .gguf file: q4) or run
in another dtype (its ``--dtype``).

With ``--link shm`` (ranks on one host) and ``--threads`` below the host's cores,
the GEMM, attention, memory, projection, KV read and elementwise rates are measured again with
every core and saved as the profile's ``lead``: on one host, rank 0 runs a step
that splits no prompt (a P > 1 decode step) with every rank's threads, and `ctxpar
estimate` times those steps at these rates.

``--link 1gbit|10gbit|100gbit|rdma`` also measures a gloo all-gather between
two network namespaces linked through a switch by veths shaped with tc tbf to
that rate (as `ctxpar bench links`; needs root and iproute2, within
``--link-timeout`` seconds) and saves its latency and bandwidth as the
profile's link.

The rank's and the links' figures are measured by the cost model
(ctxpar/costmodel/hardware_calibration.py); the host's cost of a step through the engine
(ctxpar/entrypoints/cli/calibrate_host.py).

The launch terms of a step (ctxpar/costmodel/launch_calibration.py): the cost
of one kernel launched from Python (on the CPU, an op's dispatch). With a GPU
also the engine's kernels a decoder layer (counted by torch.profiler on the
eager engine), a CUDA graph's replay and each kernel inside one: the profile
then prices decode steps as graph replays, as the engine runs them unless
``enforce_eager``. The GPU measurements are written but were not run where
this was written (no GPU): `python -m ctxpar.bench.cuda_graph_check` checks them.

With a GPU (``--device cuda``, or ``auto`` where one is visible) the FLOP/s,
the bandwidth and the memory are the GPU's; the link is still measured between
two host processes (NCCL between GPUs is not), which the profile says.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ctxpar.checks import max_threads, positive_int, usable_cores
from ctxpar.costmodel.hardware import CALIBRATED_WEIGHT_DTYPES
from ctxpar.costmodel.link_calibration import TIMEOUT_S
from ctxpar.costmodel.netns import LINKS, check_tools
from ctxpar.costmodel.profiles import DEFAULT_PROFILE_FILE
from ctxpar.errors import CtxparError
from ctxpar.machine import cpu_info


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default=DEFAULT_PROFILE_FILE,
        help="where to write the profile JSON (the engine derives its PCP policy from ./hardware-profile.json)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="threads of the rank measured (default: every usable core)"
    )
    p.add_argument(
        "--dtype",
        choices=tuple(CALIBRATED_WEIGHT_DTYPES),
        default=None,
        help="the weights' dtype the profile's rates are for: fp32 or bf16 (the activations' too), or q4 "
        "(GGUF Q4_0 blocks with fp32 activations, the engine's default for such a file) "
        "(default: what ctxpar picks here: bf16 on CPUs with native bf16, else fp32)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the rank measured: the CPU or the first GPU (default: auto, a GPU where there is one, "
        "as the engine's --device); cuda also measures the launch and CUDA-graph terms (a path written "
        "without a GPU to run it on: python -m ctxpar.bench.cuda_graph_check checks it)",
    )
    p.add_argument(
        "--link",
        choices=("shm", "gloo", *LINKS),
        default="shm",
        help="the link the profile's latency and bandwidth are for: shm (ranks on one host), gloo (across "
        "hosts, measured over loopback), or a link shaped between two network namespaces: "
        + ", ".join(f"{name} ({what})" for name, (_, what) in LINKS.items())
        + " (root)",
    )
    p.add_argument(
        "--link-timeout",
        type=positive_int,
        default=TIMEOUT_S,
        metavar="S",
        help=f"seconds the shaped link's measurement may take, at most ({TIMEOUT_S})",
    )


def run(args: argparse.Namespace) -> None:
    threads = usable_cores() if args.threads is None else args.threads
    if not 1 <= threads <= max_threads():
        raise CtxparError(f"--threads must be in [1, {max_threads()}], got {threads}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise CtxparError(f"--out {out}: directory {out.parent} does not exist")
    if args.link in LINKS:
        check_tools()  # before half a minute of other measurements
    from ctxpar.costmodel.hardware_calibration import calibrate
    from ctxpar.device import auto_dtype, resolve_device
    from ctxpar.entrypoints.cli.calibrate_host import host_overhead, kernels_per_layer

    device = resolve_device(args.device)
    dtype = args.dtype or ("bf16" if auto_dtype(device.type) == "bfloat16" else "fp32")
    print(f"CPU: {cpu_info().model}, {usable_cores()} usable cores, {threads} thread(s), {dtype}", flush=True)
    if device.type == "cuda":
        import torch

        print(f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    progress = lambda line: print(line, flush=True)
    profile = calibrate(
        threads, dtype, args.link, progress, host_overhead, device, args.link_timeout, kernels_per_layer
    )
    try:
        out.write_text(profile.to_json())
    except OSError as e:
        raise CtxparError(f"cannot write {out}: {e}") from None
    print(f"profile written to {out}", file=sys.stderr)
