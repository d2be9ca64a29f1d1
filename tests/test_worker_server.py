"""The loader workers' fork server started by train.py before its own imports (``megabatch/runtime/process.py``:
``early_worker_server``), where a run will use it, and never from the server's own preload of train.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megabatch.runtime.process import early_worker_server

ROOT = Path(__file__).resolve().parents[1]


def test_the_fork_server_starts_early_only_where_the_run_will_use_it(tmp_path, monkeypatch):
    gpu = tmp_path / "nvidiactl"
    gpu.touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert early_worker_server(["batch=4096", "data=webdataset"], gpu_node=str(gpu))
    assert not early_worker_server([], gpu_node=str(tmp_path / "none"))  # no GPU on this node
    for unused in ("data.worker_start=fork", "data.num_workers=0", "trainer.device=cpu", "++data.num_workers=0",
                   "data.worker_start='fork'", "--help", "--cfg"):
        assert not early_worker_server(["batch=64", unused], gpu_node=str(gpu)), unused
    assert early_worker_server(["data.num_workers=12", "data.worker_start=forkserver"], gpu_node=str(gpu))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
    assert not early_worker_server([], gpu_node=str(gpu))


SERVER = """
import runpy, sys
from multiprocessing import forkserver
import megabatch.runtime.process as process
process.early_worker_server = lambda argv: True  # as on a GPU node
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__mp_main__")  # the server's preload imports train.py so: none started
assert forkserver._forkserver._forkserver_pid is None
process.configure_process([])  # train.py run as the entry point: started now
pid = forkserver._forkserver._forkserver_pid
assert pid is not None
process.start_worker_server()  # configure_loading's, later: the same server
assert forkserver._forkserver._forkserver_pid == pid
import multiprocessing
worker = multiprocessing.get_context("forkserver").Process(target=print, args=("from a worker",))
worker.start()  # the server has imported the data modules and train.py, and forks a worker
worker.join(60)
assert worker.exitcode == 0, worker.exitcode
print("server", pid)
"""


def test_train_py_starts_the_fork_server_as_the_entry_point_not_from_the_servers_preload():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    ran = subprocess.run([sys.executable, "-c", SERVER, str(ROOT / "train.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "from a worker" in ran.stdout and "server" in ran.stdout
