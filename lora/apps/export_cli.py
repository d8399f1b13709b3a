"""``python -m lora export``: the forward, the forward of many adapters in one
batch and the training step as ES modules for web pages (lora.apps.web,
lora.apps.web_many, lora.apps.web_train), the peft adapter-file module
beside them (web_assets/adapter.mjs), and the demo and digits pages; ``--open``
and ``--screenshot`` run a page in headless Chromium and print its verdict.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..core.shape import LayerShape
from ..core.strategy import Entry, Strategy


def add_parser(sub) -> None:
    """The export command's arguments, on the command line's subparsers."""
    e = sub.add_parser("export", help="the forward as an ES module for web pages, or a demo page")
    e.add_argument("--rank", type=int, default=8)
    e.add_argument("--in-dim", type=int, default=2560)
    e.add_argument("--out-dim", type=int, default=2560)
    e.add_argument("--tokens", type=int, default=1)
    e.add_argument("--scale", type=float, default=2.0, help="alpha / rank (default 2)")
    e.add_argument("--strategy", help="a strategy text (default single:256:1 for one token, "
                                      "split:256 for more)")
    e.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                   help="storage of A, B, x and output (f16 needs shader-f16 in the browser)")
    e.add_argument("--out", metavar="DIR", help="write lora_forward.js and lora_forward.d.ts here "
                   "(and lora_adapter.js: peft files in the page)")
    e.add_argument("--package", metavar="DIR", help="also write DIR/package.json: an npm "
                   "package of the modules written into DIR (exports and types; alone, it "
                   "writes the forward there, as --out DIR)")
    e.add_argument("--package-name", default="lora-webgpu",
                   help="--package: the package's name (default lora-webgpu)")
    e.add_argument("--many", metavar="DIR", help="write lora_many.js and lora_many.d.ts here "
                   "(and lora_adapter.js): a pool of adapters of one layer (--in-dim, --out-dim, "
                   "--dtype, --max-rank) and the forward of a batch whose rows name them")
    e.add_argument("--max-rank", type=int, default=64,
                   help="--many: the largest rank the pool takes (a multiple of 4, default 64)")
    e.add_argument("--train", metavar="DIR", help="write lora_train.js and lora_train.d.ts here "
                   "(and lora_adapter.js): the whole training step, one submit a step")
    e.add_argument("--loss", choices=("mse", "xent"), default="mse", help="--train: the loss")
    e.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="--train: the optimizer (default adamw)")
    _add_optimizer_arguments(e)
    e.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="--train: peft's lora_dropout on the adapter's input (default 0; the "
                   "mask from --seed and the step count, as LayerTrainer draws it)")
    e.add_argument("--train-demo", metavar="DIR", help="write DIR/index.html: a self-contained "
                   "page fine-tuning LoRA on a frozen digits network in the browser (python -m "
                   "lora train's task; --rank, --steps, --seed; --open, --screenshot)")
    e.add_argument("--steps", type=int, default=200, help="--train-demo: steps (default 200)")
    e.add_argument("--demo", metavar="DIR", help="write a self-contained demo page DIR/index.html")
    e.add_argument("--adapter", metavar="DIR", help="a peft adapter directory: its weights (and "
                   "shapes and scale) go into the page instead of random ones")
    e.add_argument("--module", help="with --adapter: the layer to use (default: the first)")
    e.add_argument("--seed", type=int, default=0, help="seed of the page's random inputs")
    e.add_argument("--repeat", type=int, default=20, help="forwards the page times (default 20)")
    _add_lm_arguments(e)
    e.add_argument("--open", action="store_true",
                   help="run the demo page in headless Chromium and print its verdict")
    e.add_argument("--screenshot", metavar="PNG", help="--open, and save a screenshot of the page")


def _add_optimizer_arguments(e) -> None:
    """--train's optimizer settings."""
    e.add_argument("--lr", type=float, default=1e-3, help="--train: learning rate (default 1e-3)")
    e.add_argument("--max-grad-norm", type=float, default=None,
                   help="--train: clip the gradients' global norm to this")
    e.add_argument("--weight-decay", type=float, help="--train: decoupled weight decay "
                   "(default: the optimizer's, AdamW 0.01, SGD 0)")
    e.add_argument("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"),
                   help="--train, adamw: the moments' decay rates (default 0.9 0.999)")
    e.add_argument("--eps", type=float, help="--train, adamw: added to the root of the second "
                   "moment (default 1e-8)")
    e.add_argument("--momentum", type=float, help="--train, sgd: momentum (default 0)")
    e.add_argument("--schedule", choices=("constant", "linear", "cosine"),
                   help="--train: the learning rate's schedule, built into the kernels (default "
                   "constant; linear: warm-up then constant)")
    e.add_argument("--warmup", type=int, help="--train: warm-up steps of the schedule")
    e.add_argument("--total-steps", type=int, help="--train: steps of the cosine schedule")


def _add_lm_arguments(e) -> None:
    """--lm and --lm-demo's arguments (the others they read: --out, --package, --dtype,
    --rank, --lr and the optimizer's, --lora-dropout, --seed, --steps)."""
    e.add_argument("--lm", metavar="FOLDER", help="with --out DIR (or --package): write "
                   "lora_lm.js and lora_lm.d.ts, the causal LM of a Hugging Face model folder "
                   "(its config.json and safetensors' names and shapes) for pages and Node: "
                   "weights streamed from safetensors, logits, generate, training steps")
    e.add_argument("--lm-demo", metavar="DIR", help="with --lm: write DIR/index.html, a page "
                   "that loads that model's files, fine-tunes it on a text file (bytes as "
                   "tokens), plots the loss, samples before and after, offers the adapter")
    e.add_argument("--target-modules", default="q_proj,v_proj", help="--lm: peft's "
                   "target_modules: comma-separated names, or all-linear (default "
                   "q_proj,v_proj)")
    e.add_argument("--alpha", type=float, default=None,
                   help="--lm: lora_alpha (default: the rank)")
    e.add_argument("--rslora", action="store_true", help="--lm: use_rslora")
    e.add_argument("--batch", type=int, default=1, help="--lm: sequences a training step and "
                   "logits take (default 1)")
    e.add_argument("--seq", type=int, default=64, help="--lm: their tokens (default 64)")
    e.add_argument("--gen-batch", type=int, default=1,
                   help="--lm: prompts generate takes (default 1)")
    e.add_argument("--prompt-tokens", type=int, default=32,
                   help="--lm: the longest prompt (default 32)")
    e.add_argument("--new-tokens", type=int, default=32,
                   help="--lm: the most new tokens generate makes (default 32)")
    e.add_argument("--max-binding-size", type=int, default=None, metavar="BYTES",
                   help="--lm: maxStorageBufferBindingSize the kernels are built within "
                   "(default WebGPU's 128 MiB: weights past it go in row chunks; more must be "
                   "requested in the page)")
    e.add_argument("--max-buffer-size", type=int, default=None, metavar="BYTES",
                   help="--lm: maxBufferSize likewise (default WebGPU's 256 MiB)")


def _lm_setup(args):
    """The LMSetup of the --lm arguments."""
    from .web_lm import LMSetup, LMShapes

    targets = args.target_modules
    targets = targets if targets == "all-linear" else [t for t in targets.split(",") if t]
    limits = {key: value for key, value in (("max-storage-buffer-binding-size",
                                             args.max_binding_size),
                                            ("max-buffer-size", args.max_buffer_size))
              if value is not None}
    shapes = LMShapes(args.batch, args.seq, args.gen_batch, args.prompt_tokens, args.new_tokens)
    return LMSetup(Path(args.lm), shapes, args.dtype, targets, args.rank,
                   float(args.rank if args.alpha is None else args.alpha), args.rslora,
                   args.lora_dropout, args.seed, args.optimizer, args.lr, args.max_grad_norm,
                   _optimizer_settings(args), limits)


def _lm_files(args, command: str) -> dict:
    """{file name: (folder, text)} of --lm (and --lm-demo)."""
    from . import web_lm
    from .web_export import asset

    if args.lm_demo and not args.lm:
        raise ValueError("--lm-demo needs --lm FOLDER: the page is written for that model's "
                         "architecture and sizes")
    folder = args.package or args.out
    if not args.lm or not (folder or args.lm_demo):
        return {}
    module = web_lm.record_module(_lm_setup(args))
    files = {}
    if folder:
        files["lora_lm.js"] = (folder, web_lm.module_js(module, command))
        files["lora_lm.d.ts"] = (folder, web_lm.module_dts(command))
        files[f"{folder}/lora_adapter.js"] = (folder, asset("adapter.mjs"))
        files[f"{folder}/lora_adapter.d.ts"] = (folder, asset("adapter.d.ts"))
    if args.lm_demo:
        files[f"{args.lm_demo}/index.html"] = (args.lm_demo, web_lm.demo_page(
            module, command, steps=args.steps))
    return files


def _shape(args) -> tuple[LayerShape, Entry, dict | None]:
    """(LayerShape, strategy, embedded adapter or None) from the export arguments."""
    from .web import embedded_adapter

    adapter, dims = None, dict(rank=args.rank, in_dim=args.in_dim, out_dim=args.out_dim,
                               scale=args.scale)
    if args.adapter:
        adapter, dims = embedded_adapter(args.adapter, args.module)
    shape = LayerShape(tokens=args.tokens, dtype=args.dtype, **dims)
    default = "split" if args.tokens > 1 else "single"
    return shape, Strategy.parse(args.strategy or default), adapter


def _optimizer_settings(args) -> dict:
    """The optimizer's keyword arguments the export options give (the rest: its defaults)."""
    given = {"weight_decay": args.weight_decay, "betas": args.betas and tuple(args.betas),
             "eps": args.eps, "momentum": args.momentum, "schedule": args.schedule,
             "warmup": args.warmup, "total": args.total_steps}
    settings = {k: v for k, v in given.items() if v is not None}
    other = {"adamw": "momentum", "sgd": "betas" if "betas" in settings else "eps"}[args.optimizer]
    if other in settings:
        raise ValueError(f"--{other} is not a setting of --optimizer {args.optimizer}")
    return settings


def _files(args) -> dict:
    """{file name: (folder, text)} of every file the arguments ask for."""
    from . import web, web_many, web_train
    from .web_export import asset

    shape, strategy, adapter = _shape(args)
    command = "python -m lora " + shlex.join(args.argv)
    files = _lm_files(args, command)
    if args.lm:
        args.out = None  # --out named the language model's folder
    if args.package and args.package not in (args.out, args.train, args.many) and not args.lm:
        args.out = args.package
    if args.out:
        files["lora_forward.js"] = (args.out, web.module_js(shape, strategy, command))
        files["lora_forward.d.ts"] = (args.out, web.module_dts(command, args.dtype))
    if args.many:
        shape_many = web_many.ManyShape(args.in_dim, args.out_dim, args.dtype, args.max_rank)
        files[f"{args.many}/lora_many.js"] = (args.many, web_many.module_js(shape_many, command))
        files[f"{args.many}/lora_many.d.ts"] = (args.many, web_many.module_dts(command))
    if args.train:
        setup = web_train.TrainSetup(shape, args.loss, args.optimizer, args.lr,
                                     args.max_grad_norm, args.seed, args.lora_dropout,
                                     _optimizer_settings(args))
        files["lora_train.js"] = (args.train,
                                  web_train.module_js(web_train.record_layer(setup), command))
        files["lora_train.d.ts"] = (args.train, web_train.module_dts(command))
    for folder in {args.out, args.train, args.many} - {None, args.lm and args.package}:
        files[f"{folder}/lora_adapter.js"] = (folder, asset("adapter.mjs"))
        files[f"{folder}/lora_adapter.d.ts"] = (folder, asset("adapter.d.ts"))
    if args.package:
        _refuse_a_foreign_package(Path(args.package))
        files[f"{args.package}/package.json"] = (args.package, package_json(
            args.package_name, [Path(n).name for n, (d, _) in files.items() if d == args.package],
            command))
    if args.demo:
        files["index.html"] = (args.demo, web.demo_page(shape, strategy, command, adapter,
                                                        args.seed, args.repeat))
    if args.train_demo:
        run = web_train.DigitsRun(steps=args.steps, rank=args.rank, seed=args.seed)
        files[f"{args.train_demo}/index.html"] = (args.train_demo,
                                                  web_train.digits_page(run, command))
    return files


PACKAGE_MARK = "LoRA on WebGPU: generated by"  # package_json's description starts so


def _refuse_a_foreign_package(folder: Path) -> None:
    """ValueError (before anything is written) where ``folder`` holds a package.json this
    command did not write: ``--package .`` in a project's root replaced the project's own
    (its name, dependencies and scripts lost)."""
    import json

    path = folder / "package.json"
    if not path.exists():
        return
    try:
        found = json.loads(path.read_text())
    except (ValueError, OSError):
        found = None
    if isinstance(found, dict) and str(found.get("description", "")).startswith(PACKAGE_MARK):
        return
    name = found.get("name") if isinstance(found, dict) else None
    own = folder / "lora-webgpu"
    spec = str(own) if own.is_absolute() else f"./{own}"  # a bare name is npm's registry's
    raise ValueError(f"--package {folder}: {path} exists and was not written by "
                     f"`python -m lora export`{f' (it is {name!r})' if name else ''}; the "
                     f"package holds the modules alone: give it a folder of its own (e.g. "
                     f"--package {spec}) and add it to your project with `npm install {spec}`")


def package_json(name: str, files: list[str], command: str) -> str:
    """package.json of an npm package holding ``files``: each module exported by its
    stem (``name/lora_train``) and its file name (``name/lora_train.js``, as ESM import
    paths are often written) with its declarations; the forward (else the training
    step, else the many-adapter module) is the package's main entry."""
    import json

    from shaderdsl.export import package_version

    modules = sorted(f[:-3] for f in files if f.endswith(".js"))
    entry = {m: {"types": f"./{m}.d.ts", "default": f"./{m}.js"} for m in modules}
    main = next(m for m in ("lora_forward", "lora_lm", "lora_train", "lora_many", *modules)
                if m in modules)
    version = package_version()
    return json.dumps({
        "name": name, "version": version if version[0].isdigit() else "0.0.0",
        "description": f"{PACKAGE_MARK} `{command}` (see shaderdsl's "
                       f"docs/browser.md)",
        "type": "module", "main": f"./{main}.js", "types": f"./{main}.d.ts",
        "exports": {".": entry[main], **{f"./{m}{js}": entry[m] for m in modules
                                         for js in ("", ".js")}},
        "files": sorted(files), "sideEffects": False}, indent=2) + "\n"


def cmd_export(args) -> int:
    """Write the forward as an ES module (--out), the training step (--train),
    each with the adapter-file module beside it, and/or the demo pages
    (--demo, --train-demo)."""
    from shaderdsl.errors import ShaderDSLError

    try:
        files = _files(args)
    except (ShaderDSLError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not files:
        print("error: give --out DIR (the forward; with --lm FOLDER, the language model), "
              "--many DIR (many adapters in one batch), "
              "--train DIR (the training step), --package DIR (an npm package of them), "
              "--lm-demo DIR (with --lm: the language model's page), "
              "--demo DIR (the forward's page) and/or "
              "--train-demo DIR (the training page)",
              file=sys.stderr)
        return 2
    for name, (folder, text) in files.items():
        path = Path(folder) / Path(name).name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    if args.demo and (args.screenshot or args.open):
        return _show_page(Path(args.demo) / "index.html", args.screenshot)
    if args.train_demo and (args.screenshot or args.open):
        return _show_training_page(Path(args.train_demo) / "index.html", args.screenshot)
    return 0


def _show_page(page, screenshot) -> int:
    """Open the demo page in headless Chromium, print its verdict, save a screenshot."""
    def verdict(r):
        t = r["timings"]
        return (f"demo page in headless Chromium ({r['adapter']}): "
                f"{'ok' if r['ok'] else 'FAILED'}, max error {r['maxErr']:.3e}; compile "
                f"{t['compile']:.0f} ms, forward {t['each']:.3f} ms")
    return _open_page(page, "window.loraDemo", "demo page", verdict, screenshot, 120.0)


def _show_training_page(page, screenshot) -> int:
    """Open the training page in headless Chromium, print what it did, save a screenshot."""
    def verdict(r):
        losses = r["losses"]
        return (f"training page in headless Chromium: loss {losses[0]:.4f} -> "
                f"{losses[-1]:.4f} over {len(losses)} steps, test accuracy "
                f"{r['accuracyBefore']:.1%} -> {r['accuracyAfter']:.1%}, {r['stepMs']:.1f} ms "
                f"a step")
    return _open_page(page, "window.loraTrainDemo", "training page", verdict, screenshot, 600.0)


def _open_page(page, until: str, what: str, verdict, screenshot, timeout: float) -> int:
    """Load ``page`` until ``until`` is set, print ``verdict(result)`` (or its
    error), save the screenshot; 0 where the page says ok."""
    from shaderdsl.browser import load_page

    result = load_page(page, until, timeout=timeout, screenshot=screenshot)
    if result.get("error"):
        print(f"{what}: error: {result['error']}", file=sys.stderr)
        return 1
    print(verdict(result))
    if screenshot:
        print(screenshot)
    return 0 if result["ok"] else 1
