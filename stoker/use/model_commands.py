"""`stoker eval` and `stoker predict`: their flags and what they print. Nothing here imports torch until a command
runs (`stoker --help` stays fast); a user error (not a model file, no images, an unknown class) is one line on
stderr and exit 2, before any producer starts."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from stoker.common.urls import data_location

USAGE_ERROR = 2
INTERRUPTED = 130
DEFAULT_BATCH_SIZE = 64
DEFAULT_TOP_K = 5


def add_parsers(commands: Any) -> None:
    evaluate = commands.add_parser("eval", help="evaluate a trained model on a labelled folder: loss, top-1, top-5, "
                                   "per class, confusion matrix")
    evaluate.add_argument("model_file", type=Path, metavar="MODEL.pt", help="model.pt, model_best.pt or model_ema.pt "
                          "(or the run folder: its model.pt)")
    evaluate.add_argument("--data", type=data_location, required=True, metavar="DIR|SHARDS|URL",
                          help="ImageFolder root (a sub-folder per class, named as in training), shards or Parquet "
                          "files, local or at an https:// or s3:// URL")
    evaluate.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON to FILE ('-': to "
                          "stdout, the table then goes to stderr)")
    _inference_flags(evaluate)
    evaluate.set_defaults(run=eval_command)
    predict = commands.add_parser("predict", help="predict the classes of a folder of images (searched "
                                  "recursively), as CSV on stdout")
    predict.add_argument("model_file", type=Path, metavar="MODEL.pt", help="model.pt, model_best.pt or model_ema.pt "
                         "(or the run folder: its model.pt)")
    predict.add_argument("images", type=Path, metavar="IMAGES_DIR", help="folder of images, class sub-folders "
                         "or none")
    predict.add_argument("--top-k", type=_positive, default=DEFAULT_TOP_K, metavar="K",
                         help=f"classes per image, most probable first (default {DEFAULT_TOP_K})")
    _inference_flags(predict)
    predict.set_defaults(run=predict_command)


def _inference_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", dest="model_code", default=None, metavar="MODULE:FUNCTION",
                        help="the model the file was trained with, when it is code of your own: a model file "
                        "that names a module:function is refused unless you name the same one here (a model "
                        "file must not choose what code runs); a built-in model needs none")
    parser.add_argument("--accept-changed-module", action="store_true",
                        help="import the --model module as it is now even when its file differs from the one the "
                        "model was trained with (a warning says what differs; the weights must still fit)")
    # Checked as train's settings of the same names are (use/inference_settings.py), before torch is imported.
    parser.add_argument("--devices", default="auto", metavar="SPEC",
                        help="auto | cpu | cuda | cuda:0,1: a model replica on each (default auto)")
    parser.add_argument("--batch-size", default=DEFAULT_BATCH_SIZE, metavar="B",
                        help=f"images per batch (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--producers", default="auto", metavar="M",
                        help="auto (fork more while the devices wait) or a fixed count (default auto)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def _check_settings(args: argparse.Namespace) -> Any:
    """The settings that need neither the model nor the images, checked before either is read."""
    from stoker.use.inference_settings import InferenceSettings

    settings = InferenceSettings(devices=args.devices, batch_size=args.batch_size, producers=args.producers)
    json_file = getattr(args, "json", None)
    if json_file is not None and str(json_file) != "-" and not json_file.parent.is_dir():
        raise ValueError(f"json={str(json_file)!r}: the folder {str(json_file.parent)!r} does not exist "
                         "(expected a file in an existing folder, or '-' for stdout)")
    return settings


def eval_command(args: argparse.Namespace) -> int:
    def run() -> None:
        settings = _check_settings(args)
        from stoker.observe.eval_report import eval_table
        from stoker.use.evaluate import evaluate
        result = evaluate(args.model_file, args.data, settings, model=args.model_code,
                          accept_changed_module=args.accept_changed_module)
        to_stdout = args.json is not None and str(args.json) == "-"
        print(eval_table(result), file=sys.stderr if to_stdout else sys.stdout)
        if to_stdout:
            print(json.dumps(result, indent=1))
        elif args.json is not None:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.json}", file=sys.stderr)

    return _guarded(run)


def predict_command(args: argparse.Namespace) -> int:
    def run() -> None:
        settings = _check_settings(args)
        from stoker.use.evaluate import predict, prediction_rows

        k, predictions = predict(args.model_file, args.images, args.top_k, settings, model=args.model_code,
                                 accept_changed_module=args.accept_changed_module)
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerows(prediction_rows(predictions, k))
        bad = sum(1 for p in predictions if p.error)
        print(f"{len(predictions) - bad} images predicted" + (f", {bad} unusable (listed with the reason in the "
              "error column)" if bad else ""), file=sys.stderr)

    return _guarded(run)


def _guarded(run: Any) -> int:
    """A user error is one line and exit 2; Ctrl-C exit 130 (the Loader stops its producers on the way out)."""
    try:
        run()
    except ValueError as error:  # ModelFileError, a bad folder, an unknown class, a bad setting
        print(f"stoker: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("stoker: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0
