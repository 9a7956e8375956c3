"""The classic PyTorch MNIST example made elastic: mnist_plain.py, ported to keepstep.

The same CNN, Adadelta and per-epoch StepLR as mnist_plain.py, on the same data. The port
builds the job from the model, the optimizer and the dataset (keepstep draws the sample
order and dropout, keyed by step and micro-batch), tracks the scheduler, and steps it after
the commit of an epoch's last step: the epoch is read from the committed step's index, so a
step repeated after a fault never advances it twice. Alone (one member):

    scripts/env python examples/mnist.py --global-batch 32 --micro-batch 8 --steps 6

or under `keepstep run --nodes 2 ... examples/mnist.py`, which sets the job's numbers.
tests/launch/test_example_ports.py counts the lines this port changes.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset, TensorDataset

import keepstep

MEAN, STD = 0.1307, 0.3081  # MNIST's pixel mean and deviation: the usual normalization


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))  # 28x28 -> 26x26 -> 24x24
        x = self.dropout1(F.max_pool2d(x, 2)).flatten(1)  # 64 channels of 12x12
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic(n: int, seed: int) -> TensorDataset:
    """n 1x28x28 images in ten classes: each class one fixed blot pattern, moved by up to
    three pixels and under noise. The patterns are the same for every seed (train and
    test share them); the seed picks the samples."""
    patterns = torch.Generator().manual_seed(1234)
    dots = (torch.rand(10, 1, 28, 28, generator=patterns) < 0.04).float()
    blots = F.max_pool2d(dots, 5, stride=1, padding=2)  # each dot grows into a 5x5 blot
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    shifts = torch.randint(-3, 4, (n, 2), generator=g).tolist()
    moved = [blots[c].roll(s, dims=(1, 2)) for c, s in zip(labels.tolist(), shifts, strict=True)]
    images = torch.stack(moved)
    images = (images + 0.3 * torch.randn(images.shape, generator=g)).clamp(0.0, 1.0)
    return TensorDataset((images - MEAN) / STD, labels)


def mnist(folder: str | None, samples: int, train: bool) -> Any:
    """torchvision's MNIST in `folder`, or `samples` synthetic ones (a quarter for test)."""
    if folder is None:
        return synthetic(samples if train else samples // 4, seed=1 if train else 2)
    # Imported only when asked for: torchvision is often not installed.
    datasets = importlib.import_module("torchvision.datasets")
    transforms = importlib.import_module("torchvision.transforms")
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    return datasets.MNIST(folder, train, normalize, download=True)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: Dataset[Any]) -> float:
    model.eval()
    right = total = 0
    for data, target in torch.utils.data.DataLoader(dataset, batch_size=500):
        right += int((model(data).argmax(dim=1) == target).sum())
        total += len(target)
    return right / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, help="samples per step")
    parser.add_argument("--micro-batch", type=int, help="samples per forward pass")
    parser.add_argument("--steps", type=int, help="optimizer steps")
    parser.add_argument("--seed", type=int, help="the seed of the sample order and dropout")
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta's learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="LR factor after each epoch")
    parser.add_argument("--samples", type=int, default=2048, help="synthetic training set size")
    parser.add_argument("--data", help="a folder for torchvision's MNIST (instead of synthetic)")
    args = parser.parse_args()

    torch.manual_seed(1)  # the initial weights
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    dataset, test_set = mnist(args.data, args.samples, True), mnist(args.data, args.samples, False)
    job = keepstep.init(model, optimizer, dataset, args.global_batch, args.micro_batch, args.seed)
    job.track("sched", scheduler)
    model.train()
    for step in job.steps(args.steps):
        for mb in step.micro_batches():
            step.backward(F.nll_loss(model(mb.inputs), mb.targets))
        if step.commit() and (step.index + 1) % (len(dataset) // job.config.global_batch) == 0:
            scheduler.step()
    print(f"test accuracy {accuracy(model, test_set):.3f} lr {scheduler.get_last_lr()[0]:.4f}")
    if not job.left:  # every member that trained to the end: their hashes must agree
        print(f"final params_sha256={job.params_sha256()} sched={job.state_sha256('sched')}")


if __name__ == "__main__":
    main()
