"""Plain-PyTorch models for the benchmarks: an MLP and a small ResNet-style CNN."""

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(
        self, inputs: int = 784, width: int = 1024, depth: int = 4, classes: int = 10
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.Sequential(*(MLPBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def mlp():
    return MLP()


def mlp_inputs(device, batch_size=256):
    return torch.randn(batch_size, 784, device=device), torch.randint(
        0, 10, (batch_size,), device=device
    )


def classify_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class CNN(nn.Module):
    def __init__(self, channels: int = 64, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(ResBlock(channels), ResBlock(channels))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


def cnn():
    return CNN()


def cnn_inputs(device, batch_size=16, image_size=64):
    return (
        torch.randn(batch_size, 3, image_size, image_size, device=device),
        torch.randint(0, 100, (batch_size,), device=device),
    )
