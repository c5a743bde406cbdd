"""ZeRO data-parallel training with DeepSpeed, in the style of DeepSpeed's getting-started examples.

    torchrun --nproc_per_node 2 train_ds.py --zero-stage 2 --steps 4
    deepspeed --num_gpus 2 train_ds.py --zero-stage 2 --steps 4
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import SimpleNet, two_blobs


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO example")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def main() -> None:
    args = get_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()

    torch.manual_seed(args.seed)
    model = SimpleNet()
    trainset = two_blobs(256, seed=args.seed)
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=model.parameters(),
        training_data=trainset,
        config=ds_config(args),
    )
    print(
        f"rank {rank}: ZeRO stage {engine.zero_optimization_stage()}, "
        f"global batch {engine.train_batch_size()}, {len(trainloader)} batches per epoch"
    )

    for step, (inputs, labels) in enumerate(trainloader):
        if step == args.steps:
            break
        outputs = engine(inputs.to(engine.device))
        loss = F.cross_entropy(outputs, labels.to(engine.device))
        engine.backward(loss)
        engine.step()
        print(f"rank {rank}: step {step} loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
