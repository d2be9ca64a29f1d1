"""JPEG decoding on the GPU, side by side: nvJPEG's CUDA decoder through torchvision's
``decode_jpeg(..., device="cuda")`` (the reference: one decoder per process, behind a mutex) against
nvJPEG's hardware decoders through ``megabatch.data.nvjpeg`` (one per thread), on 512-image
sub-batches of 256 px photo-like JPEGs, 1-3 decoding threads (each on its own high-priority stream,
as ``DecodePool`` runs them), with the GPU idle and beside a load that keeps it busy (bf16 matrix
products kept ~80 ms deep on the default stream, as a training step queues its kernels). Each row:
samples/s and the median and longest call. ``meta`` records CUDA_DEVICE_MAX_CONNECTIONS (importing
megabatch sets 32 unless set: run once with it set to 8, CUDA's default, to see why).

    python scripts/benchmarks/decode.py --out docs/bench/decode_h100.json

``--crops``: the crop-and-resize that follows the decoding instead (``gpu_decode.cropped_groups``),
on the same sub-batch decoded once, with ViT training's random-resized-crop boxes (scale 0.9-1.0,
bicubic, 224 px): the Triton passes (``kernels/crops.py``) against the dense float64 products of
the plain-torch form, on an idle GPU; each row: the CPU time of a call and the GPU time of its
kernels (median of calls, CUDA events), and the largest pixel difference against the dense form.

    python scripts/benchmarks/decode.py --crops --out docs/bench/crops_h100.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import threading
import time

import torch
from bench import write_results

from megabatch.data.samples import EncodedImages
from megabatch.data.synthetic import photos
from megabatch.runtime.process import configure_process


def load(stop: threading.Event, device: torch.device) -> None:
    """bf16 products on the default stream, ~40 queued at any time, until ``stop``."""
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    events = []
    while not stop.is_set():
        for _ in range(5):
            x @ x
        event = torch.cuda.Event()
        event.record()
        events.append(event)
        if len(events) > 8:
            events.pop(0).synchronize()
    torch.cuda.synchronize(device)


def decoder(name: str, encoded: EncodedImages, device: torch.device):
    """A function that decodes the sub-batch once on the current stream and waits for it (the
    bytes in ``encoded.blob``: pageable or page-locked, as given)."""
    if name == "torchvision":
        from torchvision.io import ImageReadMode, decode_jpeg

        views = encoded.views()

        def run():
            decode_jpeg(views, mode=ImageReadMode.RGB, device=device)
            torch.cuda.current_stream(device).synchronize()
        return run
    from megabatch.data import nvjpeg

    starts, lengths = encoded.offsets[:-1], encoded.offsets.diff()
    shapes = torch.tensor([[256, 256]] * len(encoded))

    def run():  # (the hardware decoder waits for its own work)
        nvjpeg.hardware_decoder(device).decode(encoded.blob, starts, lengths, shapes)
    return run


def measure(name: str, encoded: EncodedImages, device: torch.device, threads: int, seconds: float) -> dict:
    """Calls per second of ``threads`` threads decoding ``encoded`` for ``seconds``."""
    times, stop_at = [], time.perf_counter() + seconds

    def work():
        stream = torch.cuda.Stream(device, priority=-1)
        with torch.cuda.stream(stream):
            run = decoder(name, encoded, device)
            run()  # warm: the thread's decoder made, buffers allocated
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - start
    times.sort()
    return {"samples_s": round(len(times) * len(encoded) / wall), "calls": len(times),
            "median_ms": round(1e3 * times[len(times) // 2], 1) if times else None,
            "max_ms": round(1e3 * times[-1], 1) if times else None}


def crops(encoded: EncodedImages, device: torch.device, seconds: float) -> list[dict]:
    """``cropped_groups`` on ``encoded`` decoded once, with and without the Triton kernel."""
    import torchvision.transforms.v2 as T2

    from megabatch.data.gpu_decode import cropped_groups, stacked_by_size
    from megabatch.data.transforms import crop_box

    decoded = [image.to(device) for image in _decoded(encoded, device)]
    transform = T2.RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=T2.InterpolationMode.BICUBIC)
    boxes = torch.tensor([crop_box(transform, *image.shape[1:], seed) for seed, image in enumerate(decoded)])
    groups = stacked_by_size(decoded)
    rows, reference = [], None
    for kernel in (False, True):
        run = functools.partial(cropped_groups, groups, boxes, (224, 224), "bicubic", kernel=kernel)
        result = run()  # warm: compiled, buffers allocated
        torch.cuda.synchronize(device)
        cpu, gpu, stop_at = [], [], time.perf_counter() + seconds
        while time.perf_counter() < stop_at:
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            start_event.record()
            run()
            end_event.record()
            cpu.append(time.perf_counter() - start)
            end_event.synchronize()
            gpu.append(start_event.elapsed_time(end_event) / 1e3)
        reference = result if reference is None else reference
        cpu.sort()
        gpu.sort()
        rows.append({"crops": "triton" if kernel else "dense_float64_products", "images": len(decoded),
                     "calls": len(cpu), "cpu_ms": round(1e3 * cpu[len(cpu) // 2], 2),
                     "gpu_ms": round(1e3 * gpu[len(gpu) // 2], 2),
                     "max_difference": int((result.int() - reference.int()).abs().max()),
                     "differing_fraction": float((result != reference).float().mean())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _decoded(encoded: EncodedImages, device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(encoded.views(), mode=ImageReadMode.RGB, device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512, help="images per decode call (a sub-batch)")
    parser.add_argument("--threads", default="1,2,3")
    parser.add_argument("--seconds", type=float, default=3.0, help="per row")
    parser.add_argument("--decoders", default="torchvision,hardware")
    parser.add_argument("--inputs", default="pageable",
                        help="where the JPEG bytes are: pageable (the loader's), pinned (page-locked), or both")
    parser.add_argument("--crops", action="store_true", help="measure the crop-and-resize, not the decoding")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    configure_process()  # what train.py sets first, before CUDA starts: the decoding streams' queues
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode.py measures GPU decoding and needs a CUDA GPU")
    device = torch.device("cuda")
    encoded = EncodedImages.from_bytes([sample.image for sample in photos(args.images, 256)],
                                       list(range(args.images)))
    if args.crops:
        write_results(args.out, crops(encoded, device, args.seconds), images_per_call=args.images, jpeg_px=256)
        return
    results = []
    for busy in (False, True):
        stop = threading.Event()
        loader = threading.Thread(target=load, args=(stop, device)) if busy else None
        if loader is not None:
            loader.start()
            time.sleep(0.5)
        try:
            for name, inputs in itertools.product(args.decoders.split(","), args.inputs.split(",")):
                blob = encoded.blob if inputs == "pageable" else encoded.blob.pin_memory()
                given = EncodedImages(blob, encoded.offsets, encoded.positions)
                for threads in (int(t) for t in args.threads.split(",")):
                    row = {"decoder": name, "inputs": inputs, "threads": threads, "gpu_busy": busy,
                           **measure(name, given, device, threads, args.seconds)}
                    print(json.dumps(row), flush=True)
                    results.append(row)
                    write_results(args.out, results, images_per_call=args.images, jpeg_px=256,
                                  cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        finally:
            stop.set()
            if loader is not None:
                loader.join()


if __name__ == "__main__":
    main()
