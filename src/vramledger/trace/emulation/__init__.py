"""The GPU that is not there: device policies (what CUDA decides differently from the CPU), the
emulated ``torch.cuda`` and ``torch.accelerator``, and the device-side libraries' memory
(paged optimizer states, Triton launches)."""
