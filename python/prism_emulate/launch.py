"""Runs an unmodified training script as a real rank of a Prism emulation:

    python3 -m prism_emulate.launch [--keep-backend] SCRIPT [ARGS...]
    python3 -m prism_emulate.launch -m MODULE [ARGS...]

The coordinator (``prism emulate ... -- COMMAND``) sets PRISM_RANK, PRISM_WORLD_SIZE and
PRISM_COORDINATOR. The launcher registers the ``prism`` torch.distributed backend and wraps
``torch.distributed.init_process_group`` and ``new_group`` so that a script asking for
``nccl``, ``gloo`` (or any backend, unless --keep-backend) gets ``prism``, with rank and world
size from the environment and a local HashStore (an env:// TCPStore would wait for every rank
of the world, and most ranks are virtual). RANK, WORLD_SIZE and LOCAL_RANK are set for scripts
that read them. At exit the session ends with Bye carrying the peak memory
(torch.cuda.max_memory_allocated() when CUDA is in use, else 0).
"""

import atexit
import os
import runpy
import sys

REPLACED = ("nccl", "gloo", "mpi", "ucc", "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl")


def parse_args(argv):
    """(keep_backend, module or None, script or None, script argv) from the launcher's argv."""
    keep = False
    args = list(argv)
    while args and args[0].startswith("--") and args[0] != "--":
        if args[0] == "--keep-backend":
            keep = True
            args.pop(0)
        else:
            raise SystemExit(f"prism_emulate.launch: unknown option {args[0]}")
    if args and args[0] == "--":
        args.pop(0)
    if not args:
        raise SystemExit("usage: python3 -m prism_emulate.launch [--keep-backend] SCRIPT|-m MODULE [ARGS...]")
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("prism_emulate.launch: -m needs a module")
        return keep, args[1], None, args[1:]
    return keep, None, args[0], args


def choose_backend(requested, keep: bool) -> str:
    """The backend a script gets: ``prism`` for nccl/gloo/none (or anything unless keep)."""
    if requested is None:
        return "prism"
    r = str(requested).lower()
    if keep and r not in REPLACED:
        return requested
    return "prism"


def install(keep: bool = False) -> None:
    """Registers the backend and wraps init_process_group and new_group."""
    import torch.distributed as dist

    from . import torch_backend

    torch_backend.register()
    prism_rank = int(os.environ["PRISM_RANK"])
    prism_world = int(os.environ["PRISM_WORLD_SIZE"])
    os.environ.setdefault("RANK", str(prism_rank))
    os.environ.setdefault("WORLD_SIZE", str(prism_world))
    os.environ.setdefault("LOCAL_RANK", "0")
    orig_init = dist.init_process_group
    orig_new = dist.new_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, **kw):
        kw.pop("pg_options", None)
        if store is None:
            store = dist.HashStore()
        args = dict(backend=choose_backend(backend, keep), store=store, world_size=prism_world, rank=prism_rank)
        if timeout is not None:
            args["timeout"] = timeout
        args.update(kw)
        return orig_init(**args)

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        return orig_new(ranks=ranks, timeout=timeout, backend=choose_backend(backend, keep), **kw)

    dist.init_process_group = init_process_group
    dist.new_group = new_group

    def finish():
        peak = 0
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                peak = int(torch.cuda.max_memory_allocated())
        except Exception:  # noqa: BLE001 - the Bye must still go out
            peak = 0
        torch_backend.close_session(peak)

    atexit.register(finish)


def main(argv=None) -> None:
    keep, module, script, script_argv = parse_args(sys.argv[1:] if argv is None else argv)
    for k in ("PRISM_RANK", "PRISM_WORLD_SIZE", "PRISM_COORDINATOR"):
        if k not in os.environ:
            raise SystemExit(f"prism_emulate.launch: {k} is not set (the coordinator sets it)")
    install(keep)
    sys.argv = script_argv
    if module is not None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
