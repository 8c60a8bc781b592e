"""Sample images from a UViCPipeline dir, a training run dir or a checkpoint dir.

    python sample.py runs/demo_digits/pipeline --grid grid.png --num-images 64
    accelerate launch sample.py runs/cifar10_uvic_s2 --out-dir samples/ --num-images 50000 \\
        --sampler euler_maruyama --steps 1000 --batch-size 500

Image i is generated from seed `--seed + i`, so the images do not depend on --batch-size or the number of
processes; in --out-dir mode it is saved as {i:06d}.png, the work is split across processes, and files that
already exist are skipped (re-run to finish an interrupted job).
"""

import argparse
import logging

import torch
from accelerate import Accelerator

from uvic.pipelines.sampling import generate, load_pipeline, sample_to_folder, save_grid
from uvic.schedulers import SAMPLERS


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
    args = p.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    state = Accelerator()  # reads `accelerate launch` settings (processes, --cpu)
    try:
        pipe = load_pipeline(args.source, args.sampler)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    pipe.to(state.device)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        if args.grid:
            if state.is_main_process:  # a grid is small: the main process draws it alone
                seeds = list(range(args.seed, args.seed + args.num_images))
                print(save_grid(generate(pipe, seeds, args.batch_size, args.steps), args.grid, scale=args.grid_scale))
        else:
            sample_to_folder(pipe, args.out_dir, args.num_images, args.seed, args.batch_size, args.steps,
                             state.process_index, state.num_processes)
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
