"""The pieces: here, everything the GPU machine needs cut into pieces that fill a call beside the
working tree (`pack`); there, each piece taken in, in any order, every file checked by its sha256
once all its chunks are there and installed (`receive`)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import click

from specchat.inputs import file_sha256
from specchat.train.agenda import plan
from specchat.train.agenda.back import shards_here
from specchat.train.datafolder import KEPT, SHARDS, kept_shards

def travelling_tree_bytes() -> int:
    """The working tree a call sends once `gpu-stage hide` has moved the heads' weights and docs/
    out (docs/prompts put back): tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True,
                           text=True).stdout.split("\0")
    hidden = [n for n in names if (n.startswith("specchat/heads/") and n.endswith(".safetensors"))
              or (n.startswith("docs/") and not n.startswith("docs/prompts/"))]
    return sum(Path(n).stat().st_size for n in set(names) - set(hidden) if n and Path(n).is_file())


def payload(data: Path, wheels: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(name there, file here) of everything the machine needs, in the order it is sent."""
    folder = Path(".gpu/payload")
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "whl").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d",
                    str(folder / "whl"), *wheels], check=True)
    data_tarball(data, folder / "data.tgz")
    files = [(f"whl/{p.name}", p) for p in sorted((folder / "whl").iterdir())] + [("data.tgz", folder / "data.tgz")]
    for head in plan.HEADS:
        files += [(f"heads/{head}/{p.name}", p) for p in sorted(Path("specchat/heads", head).iterdir())]
    for package in plan.MODEL_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise click.ClickException(f"{package} is not installed here: pip install -e '.[demo]'")
        chunks = sorted((Path(next(iter(spec.submodule_search_locations))) / "data").glob("*.bin"))
        files += [(f"model/{package}/{p.name}", p) for p in chunks]
    missing = [name for name, path in files if path.suffix == ".safetensors" and path.stat().st_size < 1024]
    if missing:
        raise click.ClickException(f"{missing[0]} is not here (run pack before gpu-stage hide)")
    return files


def data_tarball(data: Path, tarball: Path) -> None:
    """The prompts and the answers so far: the data folder's, and those the repository keeps."""
    with tarfile.open(tarball, "w:gz") as tar:
        for path in sorted(data.rglob("*")):
            if path.is_file() and path.name != "manifest.json":
                tar.add(path, arcname=str(path.relative_to(data)))
        for path in kept_answers(data):
            tar.add(path, arcname=f"{SHARDS}/{path.name}")


def kept_answers(data: Path) -> list[Path]:
    """The answers earlier blocks brought back and CPU sessions made, which the repository keeps
    (`collect --keep`, `data regenerate --keep`), but those whose shard the data folder `data` holds
    already."""
    there = {path.name for path in (data / SHARDS).glob("*.jsonl")}
    folders = sorted(folder for pattern in plan.KEPT_ANSWERS for folder in Path().glob(pattern))
    return [path for folder in folders for path in kept_shards(folder)
            if path.name.removesuffix(KEPT).removesuffix(".sha256") not in there]


@click.command()
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--wheel", "wheels", multiple=True, default=plan.WHEELS, show_default=True,
              help="A wheel the machine needs (pip download's NAME==VERSION); repeat for several.")
def pack(data, wheels):
    """Split the wheels, DATA (a `specchat data` folder) with the answers earlier blocks brought back
    (kept under docs/bench-gpu/BLOCK/answers), the bench's heads and the embedded 0.5B into
    .gpu/pieces/NN, one per call, each filling what a call carries beside the working tree."""
    budget = plan.CALL_BYTES - travelling_tree_bytes() - plan.SPARE_BYTES
    files = payload(data, wheels)
    count = write_pieces(files, budget, plan.PIECES)
    total = sum(path.stat().st_size for _, path in files)
    shutil.rmtree(".gpu/payload")
    click.echo(f"{total / 2**20:,.1f} MiB in {count} pieces of at most {budget / 2**20:.1f} MiB "
               f"(a call carries {plan.CALL_BYTES / 2**20:.0f} MiB; the tree takes {(plan.CALL_BYTES - budget) / 2**20:.1f}): "
               f"{count} calls, each with carry [\"{plan.PIECES}/NN\"]")


def write_pieces(files: list[tuple[str, Path]], budget: int, folder: Path) -> int:
    """Cut `files` (name there, file here), in order, into pieces folder/NN of `budget` bytes of
    chunks each, every piece with the manifest (names, sizes, sha256); how many pieces."""
    manifest = [{"name": name, "size": path.stat().st_size, "sha256": file_sha256(path)} for name, path in files]
    shutil.rmtree(folder, ignore_errors=True)
    piece, room = 0, budget
    for index, (_, path) in enumerate(files):
        with open(path, "rb") as source:
            offset = 0
            while chunk := source.read(room):
                (folder / f"{piece:02d}").mkdir(parents=True, exist_ok=True)
                (folder / f"{piece:02d}" / f"{index:03d}.{offset:012d}").write_bytes(chunk)
                offset, room = offset + len(chunk), room - len(chunk)
                if room == 0:
                    piece, room = piece + 1, budget
    pieces = sorted(folder.iterdir())
    for piece_folder in pieces:
        (piece_folder / "manifest.json").write_text(json.dumps({"pieces": len(pieces), "files": manifest}))
    return len(pieces)


def receive(piece: Path | None) -> list[str]:
    """Take a piece's chunks in, assemble and install every file whose chunks are all there, and put
    the heads into this call's checkout; the names still missing."""
    chunks, files = plan.THERE / "chunks", plan.THERE / "files"
    chunks.mkdir(parents=True, exist_ok=True)
    if piece is not None:
        for chunk in piece.iterdir():
            shutil.copy(chunk, chunks / chunk.name)
    if not (chunks / "manifest.json").is_file():
        return ["every piece"]
    manifest = json.loads((chunks / "manifest.json").read_text())["files"]
    for index, entry in enumerate(manifest):
        done = files / entry["name"]
        parts = sorted(chunks.glob(f"{index:03d}.*"))
        if done.is_file() or sum(p.stat().st_size for p in parts) < entry["size"]:
            continue
        done.parent.mkdir(parents=True, exist_ok=True)
        with open(done, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
                part.unlink()
        if file_sha256(done) != entry["sha256"]:
            done.unlink()
            raise click.ClickException(f"{entry['name']}: sha256 mismatch (send its pieces again)")
        install(entry["name"], done)
    heads = files / "heads"
    if heads.is_dir():
        shutil.copytree(heads, "specchat/heads", dirs_exist_ok=True)
    profiles = Path("specchat/profiles")
    if not profiles.exists() and not profiles.is_symlink():  # the source tree maps profiles/ to specchat.profiles
        profiles.symlink_to("../profiles")  # (pyproject); mirror that
    return [entry["name"] for entry in manifest if not (files / entry["name"]).is_file()]


def install(name: str, path: Path) -> None:
    site = plan.THERE / "site"
    if name.startswith("whl/"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), str(path)], check=True)
    elif name == "data.tgz":
        with tarfile.open(path) as tar:
            tar.extractall(plan.THERE / "data", filter="data")
        shards_here([p.name for p in (plan.THERE / "data" / SHARDS).glob("*.jsonl")])  # they come from there
    elif name.startswith("model/"):  # the chunk packages, as pip lays them out: specchat.embedded finds them
        _, package, chunk = name.split("/")
        (site / package / "data").mkdir(parents=True, exist_ok=True)
        (site / package / "__init__.py").touch()
        shutil.copy(path, site / package / "data" / chunk)


