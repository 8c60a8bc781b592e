"""Sample images from a pipeline dir (UViCPipeline or UViCText2ImagePipeline), a training run dir or a checkpoint dir.

    python sample.py runs/demo_digits/pipeline --grid grid.png --num-images 64
    accelerate launch sample.py runs/cifar10_uvic_s2 --out-dir samples/ --num-images 50000 \\
        --sampler euler_maruyama --steps 1000 --batch-size 500
    python sample.py runs/mscoco_uvic_s2/pipeline --grid grid.png --sampler uvit_dpm_solver \\
        --prompt "A red bus on a city street."                       # text-to-image: prompts
    accelerate launch sample.py runs/mscoco_uvic_s2/pipeline --out-dir samples/mscoco --num-images 30000 \\
        --features data/coco256_features --sampler uvit_dpm_solver    # text-to-image FID: random val captions
    python sample.py runs/mscoco_uvic_s2/pipeline --out-dir samples/bus --num-images 100 \\
        --prompt "A red bus on a city street."                       # many images of a prompt, one PNG each
    accelerate launch sample.py pipelines/imagenet256_uvit_huge --out-dir samples/in256 --num-images 50000 \\
        --class-labels random --batch-size 50                        # class-conditional FID: U-ViT's labels

Image i is generated from seed `--seed + i` (and, for a class-conditional model, class i % num_classes, or the
i-th of --class-labels, or label i of one draw from --seed with `--class-labels random`; for a text-to-image
model, prompt i % (number of prompts), in both modes, or a random caption of --features), so the
images do not depend on --batch-size or the number of processes; in --out-dir mode it is saved as {i:06d}.png,
the work is split across processes, and files that already exist are skipped (re-run to finish an interrupted job).
A progress bar on stderr shows images done / total, images/s and the time left (--quiet hides it, and
diffusers' pipeline-loading bar).
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.contrib.logging import logging_redirect_tqdm

from uvic.errors import (
    StorageError,
    cli_errors,
    configure_logging,
    describe_os_error,
    finite_float,
    int_at_least,
    storage_errors,
)
from uvic.io import atomic_write
from uvic.pipelines import UViCText2ImagePipeline
from uvic.pipelines.sampling import (
    check_grid_size,
    check_output,
    class_labels_for,
    generate,
    mscoco_prompt_embeds,
    sample_to_folder,
    save_grid,
)
from uvic.schedulers import sampler_names
from uvic.training.runs import load_pipeline


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            reason = describe_os_error(e) if isinstance(e, OSError) else f"not UTF-8 text ({e})"
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {reason}") from e
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    return prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="pipeline dir (model_index.json), run dir or checkpoint dir")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--grid", metavar="PNG", help="write one image grid")
    mode.add_argument("--out-dir", metavar="DIR", help="write one PNG per image (for FID)")
    p.add_argument("--num-images", type=int_at_least(1), default=None,
                   help="default: one per prompt for text prompts, else 64")
    p.add_argument("--sampler", choices=sampler_names(), default=None, help="default: the pipeline's scheduler")
    p.add_argument("--steps", type=int_at_least(1), default=50, help="sampler steps (official CIFAR-10 FID: euler_maruyama 1000)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="image i uses seed + i")
    p.add_argument("--batch-size", type=int_at_least(1), default=64)
    p.add_argument("--grid-scale", type=int_at_least(1), default=1, help="enlarge each grid image this many times (tiny images)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars (sampling, loading the pipeline)")
    t2i = p.add_argument_group("text-to-image pipelines")
    t2i.add_argument("--prompt", action="append", help="a prompt (repeat for several); image i gets prompt i %% n")
    t2i.add_argument("--prompts-file", help="one prompt per line, as --prompt")
    t2i.add_argument("--features", help="MS-COCO features root (python -m uvic.data.mscoco): random val captions "
                                        "instead of prompts; --out-dir mode (FID)")
    t2i.add_argument("--guidance-scale", type=finite_float, default=None,
                     help="diffusers convention: 1 + official scale (text-to-image and class-conditional pipelines); "
                          "default: the pipeline's (2.0 for text-to-image, the official one for ImageNet)")
    t2i.add_argument("--clip", default="openai", help="CLIP text encoder for prompts: open_clip tag, dir or file")
    cc = p.add_argument_group("class-conditional pipelines")
    cc.add_argument("--class-labels", nargs="+", metavar="ID", help="class ids (image i gets the i-th, cycling), or "
                    "`random`: U-ViT's FID labels (uniform for latent models, training-class frequencies for pixels)")
    args = p.parse_args()
    configure_logging()
    if args.quiet:  # diffusers' "Loading pipeline components" bar too, not only sample.py's own
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()

    state = Accelerator()  # reads `accelerate launch` settings (processes, --cpu)
    try:  # everything that can be checked is checked before any sampling starts
        prompts = read_prompts(args)
        if args.num_images is None:
            args.num_images = len(prompts) if prompts else 64
        if args.seed + args.num_images > 2**64:  # torch generators take seeds < 2**64
            raise ValueError(f"--seed {args.seed} + --num-images {args.num_images} exceeds the largest seed, 2**64 - 1")
        check_output(grid=args.grid, out_dir=args.out_dir, num_images=args.num_images)
        # A text encoder is only needed (and attached, if the pipeline has none) for prompts.
        pipe = load_pipeline(args.source, args.sampler, text_encoder=args.clip if prompts else None)
    except (FileNotFoundError, ValueError, StorageError) as e:
        p.error(str(e))
    text = isinstance(pipe, UViCText2ImagePipeline)
    if text and args.grid and not prompts:
        p.error("a text-to-image pipeline needs --prompt or --prompts-file for a grid")
    if text and args.out_dir and not (args.features or prompts):
        p.error("a text-to-image pipeline needs --prompt/--prompts-file or --features (extracted MS-COCO captions) "
                "for --out-dir")
    if args.features and prompts:
        p.error("--features (random captions) and --prompt/--prompts-file both choose the captions; pass one")
    if not text and (prompts or args.features):
        p.error(f"{args.source} is not a text-to-image pipeline; --prompt/--prompts-file/--features do not apply")
    try:
        labels = class_labels_for(pipe, args.num_images, args.class_labels, seed=args.seed,
                                  guidance_scale=args.guidance_scale, source=args.source)
    except ValueError as e:
        p.error(str(e))
    if args.grid:
        try:
            check_grid_size(pipe, args.num_images, args.grid_scale)
        except ValueError as e:
            p.error(str(e))
    if text and prompts and args.num_images > len(prompts):
        logging.warning("%d prompts for %d images: image i uses prompt i %% %d", len(prompts), args.num_images,
                        len(prompts))
    pipe.to(state.device)
    pipe.set_progress_bar_config(disable=True)
    if state.is_local_main_process:
        logging.info("the first batch includes one-time compilation (torch.compile of the attention on CPU, Triton "
                     "kernels on a GPU) and can take a few minutes")
    common = {"batch_size": args.batch_size, "num_inference_steps": args.steps, "guidance_scale": args.guidance_scale,
              "progress": not args.quiet and state.is_local_main_process}
    # A failed write (disk full) is one line; no partial file stays behind, and a re-run of --out-dir skips the finished
    # images.
    intact = f"; the images already in {args.out_dir} are complete: run the same command again to finish"
    with torch.inference_mode(), cli_errors(), storage_errors("sampling stopped", intact if args.out_dir else ""), \
            logging_redirect_tqdm():  # log lines go above the progress bar, never onto it
        if args.grid:
            if state.is_main_process:  # a grid is small: the main process draws it alone
                seeds = list(range(args.seed, args.seed + args.num_images))
                if text:
                    images = generate(pipe, seeds, prompts=(prompts * args.num_images)[: args.num_images], **common)
                else:  # class i % num_classes (or --class-labels), as in --out-dir mode
                    images = generate(pipe, seeds, class_labels=labels, **common)
                print(save_grid(images, args.grid, scale=args.grid_scale))
        else:
            conditions = {"class_labels": labels} if labels is not None else {}
            if labels is not None and state.is_main_process:  # which class each file used
                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                with atomic_write(Path(args.out_dir) / "class_labels.json", "w") as f:
                    json.dump(labels, f)
            if text and prompts:  # image i: prompt i % len(prompts), as in a grid
                captions = [prompts[i % len(prompts)] for i in range(args.num_images)]
                conditions = {"prompts": captions}
                if state.is_main_process:  # which caption each file used
                    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                    with atomic_write(Path(args.out_dir) / "captions.json", "w") as f:
                        json.dump(captions, f)
            elif text:
                embeds, empty, captions = mscoco_prompt_embeds(args.features, args.num_images, args.seed)
                conditions = {"prompt_embeds": embeds, "negative_prompt_embeds": empty}
                if state.is_main_process:  # which caption each file used
                    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                    (Path(args.out_dir) / "captions.json").write_text(json.dumps(captions))
            sample_to_folder(pipe, args.out_dir, args.num_images, seed=args.seed, **common, **conditions,
                             process_index=state.process_index, num_processes=state.num_processes)
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
