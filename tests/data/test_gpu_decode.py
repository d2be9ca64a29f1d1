"""data.decode=gpu: the loader workers keep JPEG bytes and draw the crop boxes on the CPU from the
per-sample seed with the CPU path's own function; the GPU decodes and cuts the same boxes. CPU
tests check the boxes, the rows the GPU would not decode, the decoder's logic (run on the CPU) and
the errors; the GPU tests check the pixels bit for bit between two decodes (phase 1 and the
offload replay) and against the CPU path."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from megabatch.config import ConfigError
from megabatch.data.gpu_decode import GpuDecoder, decode_ahead, resolve_decode
from megabatch.data.samples import EncodedImages, JpegBatch, JpegHeader, SampleDecoder, decode_rgb, probe_jpeg
from megabatch.data.transforms import crop_box, resized_crop, seeded, train_transform

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def jpeg(seed: int = 0, size=(48, 64), mode: str = "RGB", subsampling: int = 2) -> bytes:
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)).resize(size[::-1], Image.BICUBIC)
    buffer = io.BytesIO()
    coarse.convert(mode).save(buffer, format="JPEG", quality=90, subsampling=subsampling)
    return buffer.getvalue()


def png(seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_the_crop_box_is_a_pure_function_of_the_seed_shared_with_the_cpu_path():
    transform = train_transform(24)
    boxes = {seed: crop_box(transform, 48, 64, seed) for seed in range(8)}
    assert boxes[3] == crop_box(transform, 48, 64, 3)  # the same seed, the same box ...
    assert len(set(boxes.values())) > 4                 # ... another seed, another box
    torch.randn(5)  # whatever else drew random numbers in between changes nothing
    assert boxes[5] == crop_box(transform, 48, 64, 5)
    # the GPU path's box (from the header alone) is the box the CPU path cuts from the pixels
    data = jpeg()
    gpu_side, cpu_side = SampleDecoder(transform, seed=1, epoch=2, gpu=True), SampleDecoder(transform, 1, 2)
    header = gpu_side.decode(data)
    assert header == JpegHeader(48, 64, hardware=True)
    row = gpu_side(header, position=17)  # the box, then the header (a JpegBatch.boxes row)
    box = row[:4]
    assert row[4:] == (48, 64, 1)
    image = decode_rgb(data)
    assert torch.equal(cpu_side(image, 17), resized_crop(transform, image, box))
    assert box == cpu_side.box(48, 64, 17) and box != cpu_side.box(48, 64, 18)


@pytest.mark.parametrize("size,scale,ratio", [(24, (0.08, 1.0), (0.75, 4 / 3)), (224, (0.7, 1.0), (0.85, 1.18))])
def test_the_crop_box_draws_what_torchvision_draws(size, scale, ratio):
    """``crop_box`` draws on a private generator (a thread may draw while another uses the global
    one): the same boxes as torchvision's own RandomResizedCrop seeded alike, fallbacks included."""
    transform = train_transform(size, scale=scale, ratio=ratio)
    for height, width in ((40, 56), (256, 256), (100, 900), (900, 60), (5, 7), (1, 1)):
        for seed in range(100):
            shape_only = torch.zeros((), dtype=torch.uint8).expand(3, height, width)
            params = seeded(lambda image: transform.make_params([image]), shape_only, seed)
            expected = (params["top"], params["left"], params["height"], params["width"])
            assert crop_box(transform, height, width, seed) == expected, (height, width, seed)


def progressive(data: bytes) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buffer, format="JPEG", quality=90, progressive=True)
    return buffer.getvalue()


def test_only_complete_rgb_or_grey_jpegs_are_left_to_the_gpu():
    assert probe_jpeg(jpeg(mode="L")) == JpegHeader(48, 64, hardware=True)
    # the hardware decoder takes baseline JPEGs in 4:4:4, 4:2:2, 4:2:0 or grey; progressive ones go to
    # nvJPEG's CUDA decoder
    for subsampling in (0, 1, 2):
        assert probe_jpeg(jpeg(subsampling=subsampling)) == JpegHeader(48, 64, hardware=True)
    assert probe_jpeg(progressive(jpeg())) == JpegHeader(48, 64, hardware=False)
    for other in (png(), jpeg(mode="CMYK")):
        decoded = probe_jpeg(other)
        assert torch.is_tensor(decoded) and decoded.shape[0] == 3  # decoded in the worker, as before
    with pytest.raises((ValueError, OSError, RuntimeError)):
        probe_jpeg(jpeg()[:300])  # cut short: decoded here, so its error is counted in the worker


def batch_of(datas: list[bytes], size: int = 24, epoch: int = 0) -> tuple[JpegBatch, SampleDecoder]:
    decoder = SampleDecoder(train_transform(size), seed=0, epoch=epoch, gpu=True)
    return decoder.again(EncodedImages.from_bytes(datas, list(range(len(datas))))), decoder


def test_a_mixed_sub_batch_keeps_other_formats_decoded_and_the_decoder_cuts_the_boxes_on_cpu():
    datas = [jpeg(0), png(1), jpeg(2, subsampling=0), jpeg(3, mode="L")]
    batch, sample_decoder = batch_of(datas)
    assert isinstance(batch, JpegBatch) and batch.cpu_rows == [1] and batch.decoded.shape == (1, 3, 24, 24)
    images = GpuDecoder(torch.device("cpu"))(batch)  # the GPU decoder's logic, with the CPU's decoder
    cpu_path = torch.stack([SampleDecoder(sample_decoder.transform, 0, 0)(data, row) for row, data in enumerate(datas)])
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 24, 24)
    assert torch.equal(images[1], cpu_path[1])
    # the same decoder (libjpeg-turbo on the CPU): only the resize's float rounding may differ
    assert (images.int() - cpu_path.int()).abs().max() <= 1


class FakeHardware:
    """``nvjpeg.HardwareDecoder``'s interface on the CPU: decodes with libjpeg-turbo and writes each
    image through the output descriptors that ``Layout`` makes for nvJPEG."""

    def __init__(self, fail: bool = False):
        self.seen, self.fail = [], fail

    def decode(self, blob, starts, lengths, shapes):
        from megabatch.data.nvjpeg import Layout, NvJpegError

        if self.fail:
            raise NvJpegError("batched decode", 4)
        hw = shapes.numpy().astype(np.int64)
        plan = Layout.of(hw)
        out = torch.full((plan.total,), 7, dtype=torch.uint8)
        planes = plan.destinations(0, hw)  # addresses relative to the buffer
        for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            data = bytes(blob[start:start + length].numpy())
            self.seen.append(data)
            image = decode_rgb(data)
            assert tuple(image.shape[1:]) == tuple(hw[row])
            for channel in range(3):
                at, pitch = int(planes[row, channel]), int(planes[row, 4 + channel])
                assert pitch == hw[row, 1]
                out[at:at + image[channel].numel()] = image[channel].flatten()
        return [(torch.from_numpy(rows), out[at:at + len(rows) * 3 * h * w].view(len(rows), 3, h, w))
                for rows, at, (h, w) in plan.groups()]


def test_the_layout_of_a_hardware_batch_puts_each_size_in_one_tensor():
    from megabatch.data.nvjpeg import Layout

    shapes = np.array([[2, 3], [4, 5], [2, 3], [1, 1], [4, 5]])
    plan = Layout.of(shapes)
    assert plan.total == 3 * (6 + 20 + 6 + 1 + 20)
    spans = sorted((int(plan.at[row]), int(plan.at[row]) + 3 * h * w) for row, (h, w) in enumerate(shapes))
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # packed, no overlap
    groups = {(h, w): (rows.tolist(), at) for rows, at, (h, w) in plan.groups()}
    assert groups == {(1, 1): ([3], plan.at[3]), (2, 3): ([0, 2], plan.at[0]), (4, 5): ([1, 4], plan.at[1])}
    assert plan.at[2] == plan.at[0] + 18 and plan.at[4] == plan.at[1] + 60  # a group's rows follow each other
    planes = plan.destinations(1000, shapes)
    assert planes[1, :3].tolist() == [1000 + plan.at[1] + c * 20 for c in range(3)]
    assert planes[1, 4:7].tolist() == [5] * 3
    assert planes[:, 3].tolist() == [0] * 5 and planes[:, 7].tolist() == [0] * 5


@pytest.mark.parametrize("fail", [False, True])
def test_the_hardware_decoder_takes_its_rows_and_the_cuda_decoder_the_rest(monkeypatch, caplog, fail):
    """The hardware decoder gets the rows whose header it takes, grouped by size; progressive JPEGs go
    to nvJPEG's CUDA decoder, other formats stay decoded by the workers; a batch the hardware refuses
    goes to the CUDA decoder whole. The images are those of the CUDA decoder alone (here both are
    libjpeg-turbo on the CPU)."""
    from megabatch.data import nvjpeg

    datas = [jpeg(0), progressive(jpeg(1)), png(2), jpeg(3, size=(40, 56), subsampling=0), jpeg(4, mode="L"),
             jpeg(5)]
    batch, _ = batch_of(datas)
    assert batch.boxes[:, 4:].tolist() == [[48, 64, 1], [48, 64, 0], [0, 0, 0], [40, 56, 1], [48, 64, 1],
                                           [48, 64, 1]]
    fake = FakeHardware(fail=fail)
    monkeypatch.setattr(nvjpeg, "hardware_decoder", lambda device: fake)
    with_hardware = GpuDecoder(torch.device("cpu"))
    with_hardware.hardware = True
    decoded = with_hardware.decode(batch)
    if not fail:
        assert sorted(fake.seen) == sorted(datas[row] for row in (0, 3, 4, 5))
        assert len(decoded.groups) == 3  # 48x64 (rows 0, 4, 5), 40x56 (row 3), the progressive row
    else:
        assert "refused" in caplog.text
    images = with_hardware.finish(decoded)
    alone = GpuDecoder(torch.device("cpu"))(batch)
    assert torch.equal(images, alone)
    assert images.shape == (6, 3, 24, 24)


def test_the_decoding_threads_follow_data_decode_threads(monkeypatch):
    """auto: four threads (three ahead of the step) with hardware decoders, two (one) without;
    ``data.decode_threads=n``: n, all but one ahead."""
    from megabatch.data import nvjpeg

    sizes = {}
    for name, threads, hardware in (("auto-hardware", None, True), ("auto-cuda", None, False), ("six", 6, True)):
        monkeypatch.setattr(nvjpeg, "hardware_decoder", lambda device, _on=hardware: FakeHardware() if _on else None)
        decoder = GpuDecoder(torch.device("cpu"), threads=threads)
        decoder.hardware = hardware  # (on a CPU device it starts off)
        sizes[name] = (decoder.pool.threads, decoder.pool.look_ahead_threads)
        decoder.close()
    assert sizes == {"auto-hardware": (4, 3), "auto-cuda": (2, 1), "six": (6, 5)}


def test_whether_the_hardware_decoder_works_is_kept_per_gpu_so_a_warm_start_makes_none_to_size_the_pool(
        tmp_path, monkeypatch, caplog):
    """The pool's size needs to know whether the GPU's hardware JPEG decoder works: found out once by making one (0.7
    s of the main thread on an H200), then kept in ``data.cache_dir``; the next start reads it. The decoding threads'
    first try still decides for the run, and corrects a kept answer that is wrong."""
    from megabatch.data import nvjpeg

    made, works = [], [True]

    def hardware_decoder(device):
        made.append(device)
        if not works[0]:
            raise nvjpeg.NvJpegError("create (hardware backend)", 6)
        return FakeHardware()

    monkeypatch.setattr(nvjpeg, "hardware_decoder", hardware_decoder)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    kept = tmp_path / "cache" / "jpeg_hardware.json"
    cuda = torch.device("cuda")  # (no CUDA call is made: the decoder is a fake, the GPU's name patched)
    assert GpuDecoder(cuda, kept=kept)._has_hardware() and len(made) == 1  # found out, and kept
    answers = json.loads(kept.read_text())
    assert list(answers.values()) == [True] and next(iter(answers)).startswith("NVIDIA H200, CUDA ")
    warm = GpuDecoder(cuda, kept=kept)
    assert warm._has_hardware() and len(made) == 1 and warm.hardware is None  # read: none made; threads decide
    works[0] = False  # a wrong answer: the first decoding thread's try finds no hardware decoder
    assert warm._hardware_decoder() is None and warm.hardware is False
    assert list(json.loads(kept.read_text()).values()) == [False]
    assert not GpuDecoder(cuda, kept=kept)._has_hardware() and len(made) == 2
    kept.write_text("not json")  # a file that does not read: found out again
    assert not GpuDecoder(cuda, kept=kept)._has_hardware() and len(made) == 3
    assert list(json.loads(kept.read_text()).values()) == [False]
    # the decoding threads' first tries, all at once: one decides and says so
    works[0] = True
    shared = GpuDecoder(cuda, kept=kept)
    with caplog.at_level(logging.INFO, logger="megabatch"):
        tries = [threading.Thread(target=shared._hardware_decoder) for _ in range(4)]
        for thread in tries:
            thread.start()
        for thread in tries:
            thread.join()
    assert shared.hardware is True and caplog.text.count("decode on the GPU's hardware JPEG decoder") == 1
    assert list(json.loads(kept.read_text()).values()) == [True]


def test_a_corrupt_jpeg_body_becomes_a_counted_black_image(monkeypatch):
    """A JPEG whose header reads well and whose body no decoder takes (nvJPEG's batch, nvJPEG row by
    row, then libjpeg-turbo on the CPU all refuse it) becomes a black image, counted once; the
    good image beside it is decoded as it is alone. The decoders refuse the body on purpose: a real
    corrupt body may decode to grey without an error, and the test must not depend on which."""
    import torchvision.io

    from megabatch.data import gpu_decode

    good = jpeg(0)
    broken = good[:200] + bytes(len(good) - 202) + good[-2:]  # header intact, body zeroed, end marker kept
    batch, _ = batch_of([good, broken])  # the header reads well: the row is left to the GPU decoder
    real_jpeg, real_rgb = torchvision.io.decode_jpeg, gpu_decode.decode_rgb

    def is_broken(data) -> bool:
        return bytes(data.numpy() if isinstance(data, torch.Tensor) else data) == broken

    def refusing_jpeg(items, **kwargs):
        if any(is_broken(item) for item in items):
            raise RuntimeError("corrupt JPEG body")
        return real_jpeg(items, **kwargs)

    def refusing_rgb(data):
        if is_broken(data):
            raise OSError("broken data stream")
        return real_rgb(data)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refusing_jpeg)
    monkeypatch.setattr(gpu_decode, "decode_rgb", refusing_rgb)
    decoder = GpuDecoder(torch.device("cpu"))
    images = decoder(batch)
    assert images.shape == (2, 3, 24, 24)
    assert decoder.corrupt_image == 1 and images[1].sum() == 0
    alone, _ = batch_of([good])
    assert torch.equal(images[0], GpuDecoder(torch.device("cpu"))(alone)[0])


@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "nearest"])
def test_batched_crops_resize_as_torch_interpolate_does(mode):
    """The GPU path's batched crop-and-resize (two products with resampling matrices) gives
    F.interpolate's antialiased result for every crop, up to ties in the final rounding."""
    import torch.nn.functional as F

    from megabatch.data.gpu_decode import resample_matrices, resized_crops

    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
              for shape in [(3, 60, 80)] * 5 + [(3, 33, 47)]]
    boxes = torch.tensor([[0, 0, 60, 80], [5, 7, 20, 30], [10, 3, 5, 9], [0, 0, 1, 1], [2, 2, 58, 12], [1, 2, 30, 40]])
    got = resized_crops(images, boxes, (24, 24), mode, chunk_bytes=50_000, kernel=False)  # several chunks a shape
    options = {} if mode == "nearest" else {"align_corners": False, "antialias": True}
    for image, (top, left, height, width), pixels in zip(images, boxes.tolist(), got, strict=True):
        crop = image[None, :, top:top + height, left:left + width].double()
        expected = F.interpolate(crop, size=(24, 24), mode=mode, **options).clamp(0, 255).round()[0]
        assert (pixels.double() - expected).abs().max() <= 1
    for length in (1, 5, 20, 60, 256):  # the weights themselves: F.interpolate's, to float64 rounding
        eye = torch.eye(length, dtype=torch.float64)[None, None]
        expected = F.interpolate(eye, size=(24, length), mode=mode, **options)[0, 0]
        mine = resample_matrices(torch.tensor([0]), torch.tensor([length]), length, 24, mode)[0]
        assert torch.allclose(mine, expected, atol=1e-12)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "nearest"])
def test_the_crop_kernel_gives_the_plain_torch_crops(mode):
    """The two Triton passes (``kernels/crops.py``; on a CPU through the interpreter) give the dense
    plain-torch crops and F.interpolate's, for shrinking and enlarging crops, at any offset, the
    window against the image's edge, two image sizes, a chunk boundary inside a size (but where an
    exact tie, x.5, rounds the other way); and the same bits twice."""
    import torch.nn.functional as F

    from megabatch.data.gpu_decode import resized_crops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: TRITON_INTERPRET=1)
    generator = torch.Generator().manual_seed(1)
    shapes = [(3, 20, 70)] * 5 + [(3, 9, 13)] * 2
    images = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) for shape in shapes]
    boxes = torch.tensor([[0, 0, 20, 70], [3, 2, 14, 11], [5, 60, 6, 10], [0, 0, 1, 1], [19, 3, 1, 67],
                          [0, 0, 9, 13], [2, 1, 7, 5]])
    on_device = [image.to(device) for image in images]
    chunk = 3 * 16 * 70 * 8 * 3  # three of the first size's images a chunk
    with_kernel = resized_crops(on_device, boxes, (16, 16), mode, chunk_bytes=chunk, kernel=True)
    again = resized_crops(on_device, boxes, (16, 16), mode, chunk_bytes=chunk, kernel=True)
    plain = resized_crops(images, boxes, (16, 16), mode, kernel=False).int()
    assert torch.equal(with_kernel, again) and with_kernel.dtype == torch.uint8
    with_kernel = with_kernel.cpu().int()
    assert (with_kernel - plain).abs().max() <= 1 and (with_kernel != plain).float().mean() < 0.002
    options = {} if mode == "nearest" else {"align_corners": False, "antialias": True}
    for image, (top, left, height, width), pixels in zip(images, boxes.tolist(), with_kernel, strict=True):
        crop = image[None, :, top:top + height, left:left + width].double()
        expected = F.interpolate(crop, size=(16, 16), mode=mode, **options).clamp(0, 255).round()[0]
        assert (pixels.double() - expected).abs().max() <= 1
        assert (pixels.double() != expected).float().mean() < 0.002


def test_a_sub_batchs_encoded_images_cross_the_loader_as_one_tensor(tmp_path):
    """Loader workers send a sub-batch's files as one shared-memory tensor (not hundreds of pickled
    byte strings): the rows are the shards' bytes, the JpegBatch and the offload's bytes are one
    object, and the pin step moves them out of shared memory."""
    import tarfile

    from megabatch.data.position_split import PositionSplitBatches, make_loader
    from megabatch.data.read_ahead import held_bytes
    from megabatch.data.synthetic import photo_shards

    urls = photo_shards(24, 40, tmp_path / "shards", per_shard=12)
    originals = {}
    for url in urls:
        with tarfile.open(url) as tar:
            originals.update({m.name.split(".")[0]: tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")})
    dataset = PositionSplitBatches(urls, transform=train_transform(16), tokenize=lambda c: torch.zeros(len(c), 2),
                                   rank_batch=24, rank=0, world_size=1, num_batches=1, seed=0, epoch=0,
                                   sub_batch=8, keep_raw=True, gpu_decode=True)
    subs = list(make_loader(dataset, 2))
    assert len(subs) == 3
    seen = []
    for sub in subs:
        encoded = sub.raw
        assert isinstance(encoded, EncodedImages) and sub.images.data is encoded and len(encoded) == 8
        assert encoded.blob.is_shared() and not encoded.pin_memory().blob.is_shared()
        rows = [data for data, _ in encoded]
        assert [bytes(view.numpy()) for view in encoded.views()] == rows
        assert encoded.nbytes() == sum(len(row) for row in rows)
        seen += rows
    assert sorted(seen) == sorted(originals.values())  # every sample once, byte for byte
    sub = subs[0]
    assert held_bytes(sub) == sub.raw.nbytes() + held_bytes([sub.texts, sub.images.boxes])  # the shared bytes once


def test_the_decoding_threads_serve_the_replay_first_and_decode_ahead_in_order():
    """One pool serves phase 1's look-ahead and the replay: a replay task waiting behind look-ahead
    tasks runs next; ``decode_ahead`` yields in order, stays within its depth and its byte budget,
    and raises a task's error."""
    from megabatch.data.gpu_decode import DecodePool

    pool = DecodePool(torch.device("cpu"), threads=1)
    ran, release = [], threading.Event()
    pool.submit(lambda _: release.wait(10), None, DecodePool.LOOK_AHEAD)  # keeps the one thread busy
    futures = [pool.submit(ran.append, name, priority) for name, priority in
               (("ahead-1", DecodePool.LOOK_AHEAD), ("ahead-2", DecodePool.LOOK_AHEAD), ("replay", DecodePool.REPLAY))]
    release.set()
    for future in futures:
        future.result(timeout=10)
    assert ran == ["replay", "ahead-1", "ahead-2"]

    started = []
    def source():
        for index in range(50):
            started.append(index)
            yield index

    ahead = decode_ahead(source(), lambda x: x * x, pool, depth=3)
    assert next(ahead) == 0
    time.sleep(0.2)
    assert len(started) <= 1 + 3 + 1  # taken, at most depth queued, one waiting to be queued
    assert list(ahead) == [x * x for x in range(1, 50)]

    started.clear()  # within a byte budget: 400-byte results, 1000 bytes: at most 3 done ahead, one more started
    ahead = decode_ahead(source(), lambda x: torch.empty(100, device="meta"), pool, depth=40, budget_bytes=1000)
    assert next(ahead).numel() == 100
    time.sleep(0.2)
    assert 3 <= len(started) <= 1 + 3 + 1 + 1
    assert sum(result.numel() for result in ahead) == 49 * 100
    zero = decode_ahead(iter(range(5)), lambda x: torch.full((2,), x, device="meta"), pool, budget_bytes=0)
    assert [result.numel() for result in zero] == [2] * 5  # a budget of 0 still decodes one ahead

    def fails(x):
        if x == 2:
            raise ValueError("bad sub-batch")
        return x
    with pytest.raises(ValueError, match="bad sub-batch"):
        list(decode_ahead(iter(range(5)), fails, pool))
    pool.close()


def test_the_look_ahead_takes_every_decoding_thread_while_no_replay_stream_is_open():
    """Phase 1 has no replay: its look-ahead may keep every thread busy. While a replay stream is
    open (until it ends or is closed) one thread stays free for it."""
    from megabatch.data.gpu_decode import DecodePool

    pool = DecodePool(torch.device("cpu"), threads=3, look_ahead_threads=2)
    running, most, lock = [0], [0], threading.Lock()

    def work(x):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return x

    def most_running() -> int:
        most[0] = 0
        assert list(decode_ahead(iter(range(9)), work, pool, depth=9)) == list(range(9))
        return most[0]

    assert pool.look_ahead_limit() == 3 and most_running() == 3
    replay = decode_ahead(iter(range(2)), lambda x: x, pool, priority=DecodePool.REPLAY)
    assert pool.look_ahead_limit() == 2 and most_running() == 2
    replay.close()
    assert pool.look_ahead_limit() == 3
    assert list(decode_ahead(iter(range(2)), lambda x: x, pool, priority=DecodePool.REPLAY)) == [0, 1]
    assert pool.look_ahead_limit() == 3  # a replay stream read to its end is closed
    pool.close()


def test_decode_ahead_counts_whether_its_consumer_waited_for_the_source_or_the_decoding():
    """The process-wide ``wait_seconds`` the benchmarks read: a slow source shows as ``source``
    waits, slow decoding as ``decode`` waits, each under its stream's name."""
    from megabatch.data import gpu_decode
    from megabatch.data.gpu_decode import DecodePool

    pool = DecodePool(torch.device("cpu"), threads=2)

    def slow_source():
        for index in range(3):
            time.sleep(0.1)
            yield index

    def waited() -> dict:
        return dict(gpu_decode.wait_seconds)

    before = waited()
    assert list(decode_ahead(slow_source(), lambda x: x, pool)) == [0, 1, 2]
    after = waited()
    assert after["look_ahead_source"] - before.get("look_ahead_source", 0.0) >= 0.25
    assert after["look_ahead_decode"] - before.get("look_ahead_decode", 0.0) < 0.1

    def slow_work(x):
        time.sleep(0.1)
        return x
    before = waited()
    assert list(decode_ahead(iter(range(3)), slow_work, pool, priority=DecodePool.REPLAY, depth=1)) == [0, 1, 2]
    after = waited()
    assert after["replay_decode"] - before.get("replay_decode", 0.0) >= 0.15
    assert after["replay_source"] - before.get("replay_source", 0.0) < 0.1
    pool.close()


def test_decode_gpu_without_cuda_is_a_clear_error():
    assert resolve_decode("auto", torch.device("cpu")) == "cpu"
    assert resolve_decode("cpu", torch.device("cpu")) == "cpu"
    with pytest.raises(ConfigError, match="data.decode=gpu .* CUDA .* data.decode=cpu"):
        resolve_decode("gpu", torch.device("cpu"))


@cuda
def test_gpu_decoding_twice_gives_the_same_pixels_and_matches_the_cpu_path():
    device = torch.device("cuda")
    for subsampling, mean_tolerance, max_tolerance in ((0, 0.3, 1), (2, 2.5, 40)):
        datas = [jpeg(seed, size=(96, 128), subsampling=subsampling) for seed in range(16)]
        batch, sample_decoder = batch_of(datas, size=64)
        decoder = GpuDecoder(device)
        first, again = decoder(batch), decoder(batch)
        assert first.is_cuda and torch.equal(first, again)  # phase 1 and the replay: bit for bit
        cpu_path = torch.stack([SampleDecoder(sample_decoder.transform, 0, 0)(d, row) for row, d in enumerate(datas)])
        diff = (first.cpu().int() - cpu_path.int()).abs().float()
        # 4:4:4: nvJPEG and libjpeg-turbo agree; the resize's rounding differs by at most 1 (float on
        # the GPU, fixed point on the CPU; measured on an H100: mean 0.19). 4:2:0: nvJPEG upsamples the
        # chroma differently (see data/gpu_decode.py)
        assert diff.mean() <= mean_tolerance and diff.max() <= max_tolerance, (subsampling, diff.mean(), diff.max())


@cuda
def test_the_hardware_and_cuda_decoders_give_the_same_pixels():
    """Where the GPU has hardware JPEG decoders, they decode what they take to the pixels of nvJPEG's
    CUDA decoder, bit for bit (a sub-batch's rows may take either path)."""
    device = torch.device("cuda")
    datas = [jpeg(seed, size=(96, 128), subsampling=s) for seed in range(4) for s in (0, 1, 2)]
    datas += [jpeg(9, mode="L"), progressive(jpeg(10)), jpeg(11, size=(50, 70))]
    batch, _ = batch_of(datas, size=64)
    hardware = GpuDecoder(device)
    first = hardware(batch)
    if not hardware.hardware:
        pytest.skip("this GPU has no hardware JPEG decoder")
    assert torch.equal(first, hardware(batch))
    assert torch.equal(first, GpuDecoder(device, hardware=False)(batch))


@cuda
def test_the_offload_replay_decodes_on_the_gpu_the_same_pixels_as_phase_1(tmp_path):
    from megabatch.data.offload import Offload
    from megabatch.data.position_split import PositionSplitBatches, make_loader
    from megabatch.data.synthetic import photo_shards

    device = torch.device("cuda")
    urls = photo_shards(48, 64, tmp_path / "shards", per_shard=16)
    transform = train_transform(32)
    def tokenize(captions):
        return torch.zeros(len(captions), 4, dtype=torch.long)

    dataset = PositionSplitBatches(urls, transform=transform, tokenize=tokenize,
                                   rank_batch=48, rank=0, world_size=1, num_batches=1, seed=0, epoch=0,
                                   sub_batch=16, keep_raw=True, gpu_decode=True)
    decoder = GpuDecoder(device)
    first = list(decode_ahead(iter(make_loader(dataset, 2)), decoder.sub_batch, decoder.pool))
    assert all(sub.images.is_cuda and sub.images.shape == (16, 3, 32, 32) for sub in first)
    for spill_dir in (None, str(tmp_path / "spill")):
        offload = Offload(transform, seed=0, workers=2, spill_dir=spill_dir, gpu=decoder)
        kept = [offload.keep(sub.raw, sub.boxes) for sub in first]
        assert all(boxes is not None for _, boxes in kept)  # all JPEGs: the boxes are kept, not redrawn
        redrawn = [(raw, None) for raw, _ in kept]           # and drawn again from the seeds
        for replayed in (list(offload.replay_images(kept, epoch=0)), list(offload.replay_images(redrawn, epoch=0))):
            for sub, images in zip(first, replayed, strict=True):
                assert torch.equal(sub.images, images)
        offload.close()


def test_the_process_asks_cuda_for_32_hardware_queues_unless_set():
    """With CUDA's default 8 queues a decode stream shares one with the step's kernels and waits
    behind all of them (docs/bench/decode_connections8_h100.json): ``configure_process`` (train.py's
    first call) asks for 32 before torch starts, and a value the user set stays; importing megabatch
    sets nothing."""
    import os
    import subprocess
    import sys

    code = ("import os, sys, megabatch; before = os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'); "
            "from megabatch.runtime.process import configure_process; configure_process(); "
            "print(before, os.environ['CUDA_DEVICE_MAX_CONNECTIONS'], 'torch' in sys.modules)")
    env = {key: value for key, value in os.environ.items() if key != "CUDA_DEVICE_MAX_CONNECTIONS"}
    def run(environment):
        return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert run(env) == "None 32 False"  # set by the call, not the import, and before torch
    assert run({**env, "CUDA_DEVICE_MAX_CONNECTIONS": "4"}) == "4 4 False"


def test_a_gpu_without_hardware_jpeg_decoders_decodes_with_the_cuda_decoder(monkeypatch, caplog):
    """No hardware decoder (nvJPEG says "arch mismatch"): under ``auto`` the run says so once and
    decodes everything with nvJPEG's CUDA decoder; asked for explicitly, it is a clear error."""
    import logging

    from megabatch.data import nvjpeg

    def missing(device):
        raise nvjpeg.NvJpegError("create (hardware backend)", 7)

    monkeypatch.setattr(nvjpeg, "hardware_decoder", missing)
    batch, _ = batch_of([jpeg(0), jpeg(1)])
    decoder = GpuDecoder(torch.device("cpu"))
    decoder.hardware = None  # auto, as on a CUDA device
    with caplog.at_level(logging.INFO, logger="megabatch.data.gpu_decode"):
        images = decoder(batch)
    assert decoder.hardware is False and "no hardware JPEG decoder" in caplog.text and "arch mismatch" in caplog.text
    assert torch.equal(images, GpuDecoder(torch.device("cpu"))(batch))
    decoder.hardware = True  # asked for
    with pytest.raises(RuntimeError, match="hardware JPEG decoder was asked for"):
        decoder(batch)


def test_the_libnvjpeg_torchvision_ships_has_what_the_hardware_binding_calls():
    """``data/nvjpeg.py`` binds the libnvjpeg beside torchvision: every function it declares is there
    (a torchvision upgrade that dropped or renamed one would fall back to the CUDA decoder)."""
    import ctypes

    from megabatch.data import nvjpeg

    if nvjpeg.library_path() is None:
        pytest.skip("this torchvision ships no libnvjpeg")
    quick, slow = nvjpeg._bind()
    assert slow.nvjpegDecodeBatched.argtypes[-1] is not None and quick.nvjpegDecodeBatchedInitialize.argtypes
    assert ctypes.sizeof(nvjpeg._Image) == 64  # nvjpegImage_t: 4 plane pointers and 4 size_t pitches


def test_a_naflex_sub_batch_decoded_on_the_gpu_is_the_workers_packed_patches():
    """A NaFlex tower's images with ``data.decode=gpu``: the worker reads each JPEG's header and draws its crop, size
    and length (``NaFlexSpec.gpu_row``); the GPU decoder (its logic, on the CPU) cuts, resizes and packs them as the
    workers' path does: the same rows, coordinates and padding, pixels within the resize's rounding. Rows of other
    formats come packed by the worker; decoding the kept boxes again (the offload's replay) gives the same bits."""
    import torch.nn.functional as F

    from megabatch.data.naflex import NaFlexSpec, UnusableImage
    from megabatch.data.samples import NAFLEX_ROW, probe_checked

    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(9, 16), scale=(0.5, 1.0), ratio=(0.75, 4 / 3))
    datas = [jpeg(0, size=(48, 64), subsampling=0), png(1), jpeg(2, size=(40, 96), subsampling=0),
             jpeg(3, size=(64, 24), mode="L"), jpeg(4, size=(20, 20), subsampling=0), jpeg(5, size=(72, 40)),
             jpeg(6, size=(48, 64), subsampling=0), jpeg(7, size=(48, 64), subsampling=0)]  # row 0's size, other crops
    positions = list(range(3, 3 + len(datas)))
    gpu_side, cpu_side = SampleDecoder(spec, seed=1, epoch=0, gpu=True), SampleDecoder(spec, seed=1, epoch=0)
    batch = gpu_side.again(EncodedImages.from_bytes(datas, positions))
    assert isinstance(batch, JpegBatch) and batch.naflex and batch.cpu_rows == [1]
    assert batch.boxes.shape == (len(datas), NAFLEX_ROW)
    lengths = [spec.seq_len(1, 0, position) for position in positions]
    assert set(lengths) == {9, 16} and batch.size == (16, 8)  # each drew its own length: packed to the longest
    packed = GpuDecoder(torch.device("cpu"))(batch)
    want = cpu_side.collate([cpu_side(data, position) for data, position in zip(datas, positions, strict=True)], None)
    assert packed.dtype == torch.uint8 and packed.shape == want.shape == (len(datas), 16, 3 * 64 + 4)
    assert torch.equal(packed[..., -4:], want[..., -4:])  # coordinates, and which rows are padding
    assert torch.equal(packed[1], want[1])
    # the workers resize uint8 in fixed point (torchvision), the GPU path in float64 then rounds: a level or two apart
    assert (packed.int() - want.int()).abs().max() <= 2 and (packed.int() - want.int()).abs().float().mean() < 0.2
    # ... and the GPU path is F.interpolate's antialiased resize to the rounding: row 4, a crop of 16 x 17 upsampled
    top, left, height, width, *_, size_h, size_w, _ = batch.boxes[4].tolist()
    crop = decode_rgb(datas[4])[None, :, top:top + height, left:left + width].double()
    resized = F.interpolate(crop, size=(size_h, size_w), mode="bicubic", antialias=True).clamp(0, 255).round()
    patches = resized.to(torch.uint8)[0].view(3, size_h // 8, 8, size_w // 8, 8).permute(1, 3, 2, 4, 0)
    assert (size_h, size_w) == (32, 32) and torch.equal(packed[4, :16, :-4], patches.reshape(16, -1))
    assert len({tuple(batch.boxes[row, 7:9].tolist()) for row in (0, 6, 7)}) > 1  # one image size, resized apart
    jpegs = [0, 2, 4, 5, 6, 7]
    kept = EncodedImages.from_bytes([datas[row] for row in jpegs], [positions[row] for row in jpegs])
    first = GpuDecoder(torch.device("cpu"))(gpu_side.again(kept))
    assert torch.equal(GpuDecoder(torch.device("cpu"))(gpu_side.jpeg_batch(kept, batch.boxes[jpegs])), first)
    with pytest.raises(UnusableImage, match="aspect ratio"):  # read from the header: never decoded
        probe_checked(spec, jpeg(8, size=(8, 400)))


def test_sub_batches_decoded_on_the_gpu_join_with_their_boxes():
    from megabatch.data.samples import SubBatch
    from megabatch.data.token_groups import join_sub_batches

    parts = [SubBatch(torch.full((2, length, 5), length, dtype=torch.uint8), torch.ones(2, 3, dtype=torch.long),
                      None, boxes=torch.full((2, 10), length)) for length in (4, 9)]
    joined = join_sub_batches(parts)
    assert joined.images.shape == (4, 9, 5) and int(joined.images[:2, 4:].sum()) == 0
    assert torch.equal(joined.boxes, torch.cat([part.boxes for part in parts]))
    assert join_sub_batches([parts[0], parts[1]._replace(boxes=None)]).boxes is None  # the replay draws them again


@cuda
def test_a_naflex_sub_batch_decodes_on_the_gpu_twice_alike_and_as_the_workers_pack_it():
    """``data.decode=gpu`` with a NaFlex tower, on the GPU: phase 1 and the replay give the same packed bits; against
    the workers' packing the coordinates and padding are equal and the pixels close (4:4:4: the resize's rounding)."""
    from megabatch.data.naflex import NaFlexSpec

    spec = NaFlexSpec(patch_size=16, max_seq_len=64, seq_lens=(36, 64), scale=(0.5, 1.0), ratio=(0.75, 4 / 3))
    datas = [jpeg(seed, size=size, subsampling=0) for seed, size in enumerate([(96, 128), (64, 192), (160, 80)] * 4)]
    gpu_side, cpu_side = SampleDecoder(spec, seed=0, epoch=0, gpu=True), SampleDecoder(spec, seed=0, epoch=0)
    batch = gpu_side.again(EncodedImages.from_bytes(datas, list(range(len(datas)))))
    decoder = GpuDecoder(torch.device("cuda"))
    first, again = decoder(batch), decoder(gpu_side.jpeg_batch(batch.data, batch.boxes))
    assert first.is_cuda and torch.equal(first, again)
    want = cpu_side.collate([cpu_side(data, row) for row, data in enumerate(datas)], None)
    assert torch.equal(first[..., -4:].cpu(), want[..., -4:])
    diff = (first.cpu().int() - want.int()).abs().float()
    assert diff.mean() <= 0.3 and diff.max() <= 2, (diff.mean(), diff.max())
