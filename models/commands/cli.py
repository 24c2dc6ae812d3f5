"""`anima-models`: offline model tooling, one subcommand per module of models/commands/ (COMMANDS below)."""
from __future__ import annotations

import argparse
import logging
import sys

from models.commands import UserError
from models.base.lazy import import_target

# subcommand -> module defining `add_arguments(parser)` and `run(args) -> int`. Modules load only when used,
# so `anima-models pack` never imports torch.
COMMANDS = {
    "synth": ("models.commands.synth", "write synthetic checkpoints, tokenizers or a whole models folder"),
    "pack": ("models.commands.pack", "convert a DiT checkpoint into a model pack (host weights + branch ONNX)"),
    "pack-vae": ("models.commands.pack_vae", "convert a VAE file into a VAE pack (trunk + tile ONNX for one resolution)"),
    "forward": ("models.commands.forward", "one DiT forward through a pack, in process"),
    "calibrate": ("models.commands.calibrate", "collect a pack's branch inputs from real jobs (INT8 calibration)"),
    "quant-check": ("models.commands.quant_check", "an INT8 pack's branches and a whole job in the rknn-toolkit2 "
                    "simulator against the FP32 reference"),
    "verify": ("models.commands.verify", "compare a pack's branches against the FP32 reference"),
    "compile": ("models.commands.compile", "compile a DiT or VAE pack's ONNX files to RKNN with rknn-toolkit2"),
    "encode": ("models.commands.encode", "prompt -> text context [512, context_dim]"),
    "export-encoder": ("models.commands.export_encoder", "export the text encoder to ONNX (an encoder pack for the "
                       "board)"),
    "decode": ("models.commands.decode", "latent -> PNG through the VAE decoder (a VAE file, or a VAE pack)"),
    "info": ("models.commands.info", "describe a checkpoint: what it is, its config, its dtypes"),
    "bundle": ("models.commands.bundle", "everything a board runs (packs per size, compiled, the encoder) in one "
               "folder to copy"),
}


# what the host extra adds (pyproject.toml): a board install has none of them, and the commands that build packs need
# them; their absence is an install choice, answered with the extra to install, not a traceback
HOST_MODULES = ("torch", "transformers", "onnx", "safetensors", "sentencepiece", "google.protobuf")
HOST_EXTRA = "pip install 'anima-npu[host]'"




def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="anima-models", description="offline model tooling: " + ", ".join(COMMANDS))
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == wanted:  # import only the module that will run
            mod = import_target(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (UserError, ValueError, FileNotFoundError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"anima-models {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if not any(e.name == m or (e.name or "").startswith(m + ".") for m in HOST_MODULES):
            raise
        print(f"anima-models {args.command}: error: this command needs the host extra ({e}): {HOST_EXTRA}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    # run the importable module's main: under `python -m models.commands.cli` this file is __main__, and the commands raise
    # models.commands.cli.UserError, which __main__'s own copy of the class would not catch
    from models.commands.cli import main as _main
    sys.exit(_main())
