"""Sample images from a pipeline dir (UViCPipeline or UViCText2ImagePipeline), a training run dir or a checkpoint dir.

    python sample.py runs/demo_digits/pipeline --grid grid.png --num-images 64
    accelerate launch sample.py runs/cifar10_uvic_s2 --out-dir samples/ --num-images 50000 \\
        --sampler euler_maruyama --steps 1000 --batch-size 500
    python sample.py runs/mscoco_uvic_s2/pipeline --grid grid.png --sampler uvit_dpm_solver \\
        --prompt "A red bus on a city street."                       # text-to-image: prompts
    accelerate launch sample.py runs/mscoco_uvic_s2/pipeline --out-dir samples/mscoco --num-images 30000 \\
        --features data/coco256_features --sampler uvit_dpm_solver    # text-to-image FID: random val captions

Image i is generated from seed `--seed + i` (and, for a class-conditional model, class i % num_classes), so the
images do not depend on --batch-size or the number of processes; in --out-dir mode it is saved as {i:06d}.png,
the work is split across processes, and files that already exist are skipped (re-run to finish an interrupted job).
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from accelerate import Accelerator

from uvic.pipelines.export import pipeline_class_name
from uvic.pipelines.sampling import balanced_class_labels, generate, load_pipeline, sample_to_folder, save_grid
from uvic.pipelines.sampling_t2i import generate_t2i, load_t2i_pipeline, sample_t2i_to_folder
from uvic.schedulers import SAMPLERS


def is_text_to_image(source: str) -> bool:
    index = Path(source) / "model_index.json"
    return index.is_file() and pipeline_class_name(json.loads(index.read_text())) == "UViCText2ImagePipeline"


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    return prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="pipeline dir (model_index.json), run dir or checkpoint dir")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--grid", metavar="PNG", help="write one image grid")
    mode.add_argument("--out-dir", metavar="DIR", help="write one PNG per image (for FID)")
    p.add_argument("--num-images", type=int, default=64)
    p.add_argument("--sampler", choices=SAMPLERS, default=None, help="default: the pipeline's scheduler")
    p.add_argument("--steps", type=int, default=50, help="sampler steps (official CIFAR-10 FID: euler_maruyama 1000)")
    p.add_argument("--seed", type=int, default=0, help="image i uses seed + i")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--grid-scale", type=int, default=1, help="enlarge each grid image this many times (tiny images)")
    t2i = p.add_argument_group("text-to-image pipelines")
    t2i.add_argument("--prompt", action="append", help="a prompt (repeat for several); grid mode")
    t2i.add_argument("--prompts-file", help="one prompt per line; grid mode")
    t2i.add_argument("--features", help="MS-COCO features root (python -m uvic.data.mscoco); --out-dir mode")
    t2i.add_argument("--guidance-scale", type=float, default=2.0, help="diffusers convention: 1 + official scale")
    t2i.add_argument("--clip", default="openai", help="CLIP text encoder for prompts: open_clip tag, dir or file")
    args = p.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    text = is_text_to_image(args.source)
    prompts = read_prompts(args) if text else []
    if text and args.grid and not prompts:
        p.error("a text-to-image pipeline needs --prompt or --prompts-file for a grid")
    if text and args.out_dir and not args.features:
        p.error("a text-to-image pipeline needs --features (extracted MS-COCO captions) for --out-dir")
    if not text and (prompts or args.features):
        p.error(f"{args.source} is not a text-to-image pipeline; --prompt/--prompts-file/--features do not apply")

    state = Accelerator()  # reads `accelerate launch` settings (processes, --cpu)
    try:
        if text:
            pipe = load_t2i_pipeline(args.source, args.sampler, text_encoder=args.clip if args.grid else None)
        else:
            pipe = load_pipeline(args.source, args.sampler)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    pipe.to(state.device)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        if args.grid:
            if state.is_main_process:  # a grid is small: the main process draws it alone
                if text:
                    prompts = (prompts * args.num_images)[: args.num_images]
                    seeds = list(range(args.seed, args.seed + len(prompts)))
                    images = generate_t2i(pipe, seeds, args.batch_size, args.steps, args.guidance_scale,
                                          prompts=prompts)
                else:
                    seeds = list(range(args.seed, args.seed + args.num_images))
                    labels = balanced_class_labels(pipe, range(args.num_images))  # as in --out-dir mode
                    images = generate(pipe, seeds, args.batch_size, args.steps, class_labels=labels)
                print(save_grid(images, args.grid, scale=args.grid_scale))
        elif text:
            sample_t2i_to_folder(pipe, args.features, args.out_dir, args.num_images, args.seed, args.batch_size,
                                 args.steps, args.guidance_scale, process_index=state.process_index,
                                 num_processes=state.num_processes)
        else:
            sample_to_folder(pipe, args.out_dir, args.num_images, args.seed, args.batch_size, args.steps,
                             state.process_index, state.num_processes)
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
