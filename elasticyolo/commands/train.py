"""`elasticyolo train key=value ...`: train in this process (single node, no etcd).

Writes Ultralytics' run folder where Ultralytics would (`runs/detect/train`, then `train-2`, ...;
`project=`, `name=`, `exist_ok=` as Ultralytics', `run_layout.py`): args.yaml, results.csv,
results.png, weights/last.pt and best.pt, and timeline/ + timeline.png as `elasticyolo report` draws
it. `resume=true` or `resume=PATH/last.pt` continues a run from its last.pt with the options in its
args.yaml (the command line's override them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from elasticyolo.errors import UserError
from elasticyolo.spec import TrainSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("options", nargs="*", metavar="key=value",
                        help="model=yolov8n.yaml data=PATH epochs=E imgsz=S batch=B lr0=... policy=... "
                             "project=DIR name=JOB exist_ok=false patience=100 save_period=-1 cfg=FILE.yaml "
                             "resume=true|PATH")
    parser.add_argument("--progress-jsonl", type=argparse.FileType("w"), default=None,
                        help="also write one JSON record per step to this file")
    parser.add_argument("--job", default="train",
                        help="job name: the run folder's default name (runs/detect/JOB), and the checkpoints' (with "
                             "checkpoint=URI a rerun resumes this job)")
    parser.add_argument("--save", default=None, help="write the final checkpoint (.pt, loads with YOLO(path)) here")


def resume_source(options: list[str]) -> Path | None:
    """The last.pt a `resume=` option points at (None: not resuming). One-line errors."""
    spec_words = [w for w in options if w.partition("=")[0].strip() == "resume"]
    if not spec_words:
        return None
    value = spec_words[-1].partition("=")[2].strip()
    if value.lower() in ("", "false", "none", "0", "no"):
        return None
    from elasticyolo.run_layout import latest_last_pt, project_dir

    if value.lower() in ("true", "1", "yes"):
        words = dict(w.partition("=")[::2] for w in options if "=" in w)
        project = words.get("project") or None
        if words.get("name"):
            run_dir = project_dir(project) / words["name"]
            path = run_dir / "weights" / "last.pt"
            if not path.exists():
                raise UserError(f"resume=true: {path} not found (nothing to resume in {run_dir})")
            return path
        found = latest_last_pt(project)
        if found is None:
            raise UserError(f"resume=true: no run with weights/last.pt under {project_dir(project)}/ "
                            "(pass resume=PATH/last.pt)")
        return found
    path = Path(value)
    if path.is_dir():
        path = path / "weights" / "last.pt"
    if not path.is_file():
        raise UserError(f"resume={value}: {path} not found")
    return path


def resume_defaults(last_pt: Path) -> dict[str, Any]:
    """The run's own options (its args.yaml) for a resumed run."""
    import yaml

    args_yaml = last_pt.parent.parent / "args.yaml"
    if not args_yaml.exists():
        return {}
    try:
        saved = yaml.safe_load(args_yaml.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{args_yaml}: not valid YAML ({str(exc).splitlines()[0]})") from None
    known = set(TrainSpec.model_fields)
    return {k: v for k, v in saved.items() if k in known and k != "resume"}


def run(args: argparse.Namespace) -> int:
    resume_pt = resume_source(args.options)
    defaults = resume_defaults(resume_pt) if resume_pt else {}
    spec = TrainSpec.from_pairs(args.options, **defaults)
    if resume_pt and spec.checkpoint:
        raise UserError("resume= and checkpoint= both given: checkpoint=URI resumes from the store by itself; "
                        "drop one of them")
    from elasticyolo.data.yaml_check import load_data_yaml
    from elasticyolo.models import require_model

    from elasticyolo.staging.stager import resolve_for_spec

    resolve_for_spec(spec)  # an s3:// dataset is staged into the local cache first
    load_data_yaml(spec.data)  # fail fast with a clear line, before torch loads
    require_model(spec.model)
    from elasticyolo.run_layout import save_dir as new_save_dir

    save_dir = resume_pt.parent.parent if resume_pt else new_save_dir(spec.project, spec.name or args.job,
                                                                       spec.exist_ok)
    from elasticyolo.train.core import TrainCore, quiet_ultralytics
    from elasticyolo.train.loop import LocalHooks, TrainingLoop
    from elasticyolo.train.report import JsonLines, ProgressBar
    from elasticyolo.train.run_folder import RunFolder

    from elasticyolo.train.checkpointing import Checkpointer

    quiet_ultralytics()
    core = TrainCore(spec, work_dir=save_dir)
    if resume_pt:
        from elasticyolo.checkpoint.format import load_checkpoint_file
        from elasticyolo.train.state import load_core_checkpoint

        with open(resume_pt, "rb") as fh:
            load_core_checkpoint(core, load_checkpoint_file(fh))
        core.set_world(1, 0)
        if core.finished:
            raise UserError(f"resume={resume_pt}: that run already finished ({core.progress.epoch} epochs); "
                            "pass epochs=N to train further")
        print(f"resumed {save_dir} from {resume_pt}: epoch={core.progress.epoch} step={core.progress.step}",
              file=sys.stderr)
    checkpointer = Checkpointer(spec, args.job, rank=0)
    if checkpointer.restore_into(core):
        core.set_world(1, 0)
        print(f"resumed from checkpoint: epoch={core.progress.epoch} step={core.progress.step}", file=sys.stderr)
    folder = RunFolder(save_dir, core, {"job": args.job, **spec.model_dump(mode="json")})
    from elasticyolo.train.timeline import TimelineSink

    timeline = TimelineSink(save_dir)
    sinks: list[Any] = [timeline, folder]
    bar = ProgressBar(spec.epochs, core.sampler.num_samples) if sys.stderr.isatty() else None
    if bar:
        sinks.append(bar)
    if args.progress_jsonl:
        sinks.append(JsonLines(args.progress_jsonl))
    summary = TrainingLoop(core, hooks=LocalHooks(core, checkpointer), sinks=sinks).run()
    core.close()
    if bar:
        bar.close()
    if checkpointer.enabled and not checkpointer.save_now(core, reason="final"):
        print("elasticyolo train: warning: the final checkpoint did not land in time", file=sys.stderr)
    checkpointer.close()
    if args.save:
        from elasticyolo.train.state import save_checkpoint_file

        save_checkpoint_file(core, args.save)
    folder.plot()
    timeline.close()
    from elasticyolo.report import gather, render

    render(gather(args.job, run_dir=save_dir), save_dir / "timeline.png", title=f"{save_dir}")
    m = summary.metrics
    stopped = f" (stopped early: no better fitness in {spec.patience} epochs)" if core.progress.stopped else ""
    print(
        f"done: epochs={core.progress.epoch} steps={summary.steps} images={summary.images} "
        f"mAP50={m.get('mAP50', 0.0):.3f} mAP50-95={m.get('mAP50-95', 0.0):.3f} seconds={summary.seconds:.1f}"
        f"{stopped}\nresults saved to {save_dir}"
    )
    return 0
