"""`megatrain-launch CONFIG.yaml [dotted.key=value ...]`: the one entry point users run."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatrain.errors import ConfigError, DataError, MegatrainError, disk_full, free_bytes, human_bytes, is_disk_full

USAGE_ERROR, RUNTIME_ERROR = 2, 1

USAGE = (
    "megatrain-launch CONFIG.yaml [dotted.key=value ...] [--address ADDR] | export SRC OUT [--dtype D] | "
    "plan CONFIG [overrides] | status | plot RUN_DIR | tokenizer DATA... --out DIR | --cleanup [--shm-dir DIR] | "
    "--config-reference"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatrain-launch",
        usage=USAGE,
        description="Train a HF causal LM with MegaTrain's multi-process actor system.",
    )
    p.add_argument("config", nargs="?", help="YAML config file (see examples/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. optim.lr=3e-4")
    p.add_argument("--address", help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    p.add_argument(
        "--cleanup", action="store_true", help="remove the shared memory `status` says is left over (no run holds it)"
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="with --cleanup: where the shared memory lives (ipc.shm_dir)")
    p.add_argument("--config-reference", action="store_true", help="print every config key with its doc")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def cleanup(shm_dir: str = "/dev/shm") -> int:
    """Remove what `status` calls left over (ipc/shared/segments.py: one classification for both, and for a launch);
    say what stays that is not a live run, in status's words."""
    from megatrain.ipc.shared.segments import LIVE, found, sweep
    from megatrain.launch.cli.status_cmd import shm_dir_arg

    removed = sweep(shm_dir=shm_dir_arg(shm_dir))
    print(
        f"megatrain-launch: removed {len(removed)} shared-memory objects left over in {shm_dir}"
        + (":\n  " + "\n  ".join(sorted(removed)) if removed else "")
    )
    for f in found(shm_dir):
        if f.kind != LIVE:
            print(f"megatrain-launch: not removed: {f.line()}")
    return 0


# The head of docs/configuration.md, which is this command's whole output (tests/test_docs.py compares them).
REFERENCE_HEAD = """# Configuration

Every key of a run's config, with its default and meaning, generated from the config tree
(`launch/config/tree.py`). `megatrain-launch --config-reference > docs/configuration.md` rewrites this file;
`tests/test_docs.py` fails when it is out of date.

A YAML file and the `dotted.key=value` overrides after it on the command line only fill this tree: an
unknown key is an error (with a did-you-mean). An override's value is read as YAML
(`optim.betas=[0.9,0.98]`); `model.hf.hidden_size=512` sets one field of `model.hf`, while
`model.hf={hidden_size: 512}` replaces the whole mapping. `megatrain-launch CONFIG.yaml --print-config`
prints the resolved config; a run saves it as `OUTPUT_DIR/config.yaml`.

"""


def reference() -> int:
    from megatrain.config.base import reference_table
    from megatrain.launch.config.tree import Config

    print(REFERENCE_HEAD + reference_table(Config), end="")
    return 0


def _resolved_here(cfg: Any, dump: Callable[[Any], str]) -> str:
    """The config with what this machine decides made concrete (a run on a cluster decides on the GPU's node)."""
    import dataclasses

    import torch

    from megatrain.config.engine import resolve_engine

    engine = resolve_engine(cfg.engine, cfg.engine.device == "cuda" or torch.cuda.is_available())
    head = (
        "# resolved on this machine: engine.device and engine.compute_dtype from its GPU (a run decides on\n"
        "# the executor's node); ipc.staging 'auto' is decided at start from free memory (see the run's\n"
        "# config.yaml)\n"
    )
    return head + dump(dataclasses.replace(cfg, engine=engine))


def _usage_errors(command: Callable[[], int]) -> int:
    """A subcommand's ConfigError is one line on stderr and exit 2."""
    try:
        return command()
    except ConfigError as exc:
        print(f"megatrain-launch: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


def main(argv: list[str] | None = None) -> int:
    """The program (argv None: the console script, `python -m`, a Ray job's entrypoint), whose start-up counts
    from its process's start; or a call from a process that was running before (argv given)."""
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        from megatrain.launch.cli.export_cmd import main as export_main

        return export_main(argv[1:])
    if argv[:1] == ["plot"]:
        from megatrain.launch.plot.plots import main as plot_main

        return _usage_errors(lambda: plot_main(argv[1:]))
    if argv[:1] == ["plan"]:
        from megatrain.launch.cli.plan_cmd import main as plan_main

        return _usage_errors(lambda: plan_main(argv[1:]))
    if argv[:1] == ["tokenizer"]:
        from megatrain.launch.cli.tokenizer_cmd import main as tokenizer_main

        return _usage_errors(lambda: tokenizer_main(argv[1:]))
    if argv[:1] == ["status"]:
        from megatrain.launch.cli.status_cmd import main as status_main

        return _usage_errors(lambda: status_main(argv[1:]))
    args = _parser().parse_intermixed_args(argv)  # overrides may come after --address too
    if args.cleanup:
        return _usage_errors(lambda: cleanup(args.shm_dir))
    if args.shm_dir != "/dev/shm":
        _parser().error("--shm-dir goes with --cleanup (a run's own is the config key ipc.shm_dir)")
    if args.config_reference:
        return reference()
    if not args.config:
        _parser().error("a CONFIG file is required")
    # Ctrl-C, kill(1) and a dropped SSH session (SIGHUP): finish the step, checkpoint, exit 128 + signum;
    # a second one stops at once. Restored on return, for callers that run main() in-process.
    from megatrain.launch.report import console
    from megatrain.launch.run.stopping import StopRequest, settle_reads

    stop = StopRequest()
    # The console may go while the run goes on (a pipe's reader, a closed terminal): launch/report/console.py. The
    # program's own process keeps the guard to its end: Ray's shutdown and the exit's flush write after main().
    with console.guarded(restore=not program), stop.installed():
        code = _run(args, stop, program)
        # A run that failed while its inputs were still read beside Ray's start ends only once that read has
        # (launch/run/stopping.py), quietly: its error is already said. A signal means "now": no wait then.
        settle_reads(60.0, stop=lambda: stop.signum is not None)
        return code


def _launched_at(process_start: float) -> float | None:
    """When the launcher started (time.time()), for the start-up's first phase: its process's start, or, where
    a script set up the environment in that process and then exec'd Python (run-default.sh says when, in
    MEGATRAIN_EXEC_AT), the exec: the set-up is not the launcher's start. None where neither is known."""
    try:
        exec_at = float(os.environ.get("MEGATRAIN_EXEC_AT", "0"))
    except ValueError:
        exec_at = 0.0
    # A child of the launcher inherits the variable but starts after it; a stale one is never in the future.
    at = max(process_start, exec_at) if exec_at <= time.time() else process_start
    return at or None


def _run(args: argparse.Namespace, stop: Any, program: bool = False) -> int:
    trainer, where = None, None
    argv = [args.config, *args.overrides, *(["--address", args.address] if args.address else [])]
    try:
        from megatrain.config.base import dump_yaml
        from megatrain.launch.config.tree import load_tree, validate_model

        overrides = list(args.overrides) + ([f"launch.address={args.address}"] if args.address else [])
        cfg, where = load_tree(args.config, overrides)  # the model's checks: below, or in the Trainer beside Ray
        if args.print_config:
            validate_model(cfg, where)
            print(_resolved_here(cfg, dump_yaml), end="")
            return 0
        from megatrain.ipc.procs import started_at
        from megatrain.launch.run.driver import Trainer

        launched = _launched_at(started_at(os.getpid())) if program else None
        trainer = Trainer(cfg, stop, launched=launched, where=where)
        summary = trainer.run()
        if summary.complete:
            print(
                f"megatrain-launch: nothing to do: the run is complete, its checkpoint {summary.checkpoint} "
                f"is after step {summary.last_step} of {summary.steps} (raise train.steps to train on; "
                "train.resume=none with train.overwrite=true starts it again)"
            )
            return 0
        if summary.stopped_by:
            _last_line(
                f"megatrain-launch: stopped by {summary.stopped_by} after step {summary.last_step}; "
                + (_continue(trainer, argv) or "no checkpoint written"),
                trainer,
                argv,
            )
            return 128 + stop.signum
        print(
            f"megatrain-launch: done, {len(summary.metrics)} steps; metrics in {summary.output_dir / 'metrics.jsonl'}"
        )
        return 0
    except KeyboardInterrupt:
        after = _continue(trainer, argv)
        _last_line(
            f"{_interrupted(stop, trainer)}; the run's processes and shared memory were released"
            + (f"; {after}" if after else ""),
            trainer,
            argv,
        )
        return 128 + (stop.signum or signal.SIGINT)
    except (ConfigError, DataError) as exc:  # the user's input: nothing was started
        from megatrain.config.base import locate
        from megatrain.launch.config.tree import Config

        return _report(exc, locate(str(exc), where, Config), trainer, USAGE_ERROR)
    except MegatrainError as exc:
        return _report(exc, _with_free_space(str(exc), trainer), trainer, after=_resumable(trainer, argv), argv=argv)
    except OSError as exc:  # the machine's, not the input's: a full disk, a directory made read-only meanwhile
        return _report(exc, _os_error(exc, trainer), trainer, after=_resumable(trainer, argv), argv=argv)
    except Exception as exc:  # a bug of ours: still one line, the traceback goes to error.log
        message = f"internal error: {type(exc).__name__}: {exc}"
        return _report(exc, message, trainer, after=_resumable(trainer, argv), argv=argv)


def _last_line(line: str, trainer: Any, argv: list[str]) -> None:
    """The launcher's last line, on stderr and, once the output directory is the run's, in its exit.log (with
    the command that resumes it in RESUME: launch/report/rerun.py): the console may have died with the signal."""
    if getattr(trainer, "log_dir", None) is not None:
        from megatrain.launch.report.rerun import record_end

        record_end(trainer.log_dir, line, argv, trainer.cfg.train)
    print(line, file=sys.stderr)


def _interrupted(stop: Any, trainer: Any) -> str:
    """What a second signal cost: the steps since the last checkpoint (launch/run/stopping.py)."""
    from megatrain.launch.run.stopping import interrupted

    loop = getattr(trainer, "loop", None)
    last = loop.metrics[-1]["step"] if loop is not None and loop.metrics else None
    start = loop.run.start if loop is not None else 0  # no step was recorded before the loop
    return interrupted(stop.name, getattr(trainer, "log_dir", None), start, last)


def _continue(trainer: Any, argv: list[str], checkpoint_only: bool = False) -> str:
    """What running again does, once the run's output directory holds its files (launch/report/rerun.py); else ''."""
    if trainer is None or getattr(trainer, "log_dir", None) is None:
        return ""
    from megatrain.launch.report.rerun import how_to_continue

    return how_to_continue(argv, trainer.cfg.train, trainer.out, checkpoint_only)


def _resumable(trainer: Any, argv: list[str]) -> str:
    """The resume hint for a failure's line, where the run has a checkpoint to resume from."""
    after = _continue(trainer, argv, checkpoint_only=True)
    return f"; {after}" if after else ""


def _report(
    exc: BaseException,
    message: str,
    trainer: object,
    code: int = RUNTIME_ERROR,
    after: str = "",
    argv: list[str] | None = None,
) -> int:
    """One line on stderr, ending with `after` (how to resume). A run that failed (not refused input: that creates
    nothing) leaves error.log in its own output directory, with the traceback of where it failed: the failing
    actor's own when it came from one, else this process's. Where error.log cannot be written (a full disk), the
    line still comes, and says so. `argv`: the launch's, for the resume command the directory keeps (RESUME)."""
    out_dir: Path | None = getattr(trainer, "log_dir", None)
    where = ""
    if code == RUNTIME_ERROR and out_dir is not None and out_dir.is_dir():
        from megatrain.launch.control.failures import error_log

        log = out_dir / "error.log"
        try:
            log.write_text(error_log(message, exc, traceback.format_exc()))
            where = f" (details in {log})"
        except OSError as err:
            log.unlink(missing_ok=True)  # a cut-off one would only mislead
            where = f" ({log} could not be written: {err.strerror or err})"
    line = f"megatrain-launch: error: {message}{where}{after}"
    if code == RUNTIME_ERROR and argv is not None:
        _last_line(line, trainer, argv)
    else:
        print(line, file=sys.stderr)
    return code


def _os_error(exc: OSError, trainer: object) -> str:
    """An OSError of this process as one line: a full disk with the bytes free there, else what failed on
    which file."""
    where = Path(exc.filename).parent if exc.filename else getattr(trainer, "out", None)
    if is_disk_full(exc) and where is not None:
        what = f"writing {exc.filename}" if exc.filename else "a write of the run"
        return str(disk_full(where, what))
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def _with_free_space(message: str, trainer: object) -> str:
    """An actor's failure on a full disk (its OSError in its own words) with what is free in the run's output
    directory, the disk a run writes to."""
    out: Path | None = getattr(trainer, "out", None)
    if out is None or "No space left on device" not in message or "free there" in message:
        return message
    return f"{message} ({human_bytes(free_bytes(out))} free on the disk of {out})"


if __name__ == "__main__":
    sys.exit(main())
