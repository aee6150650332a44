"""`specchat cache`: what the cache folder holds, and deleting what no start reads any more."""

from __future__ import annotations

import sys

import click

from specchat.errors import SpecchatError, UsageError


@click.group(invoke_without_command=True)
@click.pass_context
def cache(context):
    """What specchat keeps in its cache folder, and deleting what no start of this version reads."""
    if context.invoked_subcommand is None:
        context.invoke(list_command)


@cache.command(name="list")
def list_command():
    """Each entry: its size, what it is and reads it, and whether it is current."""
    from specchat import cache_folder  # torch loads here (what is current depends on the kernel's sources)

    for line in cache_folder.table(cache_folder.entries()):
        click.echo(line)


@cache.command()
@click.option("--dry-run", is_flag=True, help="Say what would be deleted, and delete nothing.")
def prune(dry_run):
    """Delete what no start of this specchat would read as it is: packed models and quantized layers an
    older kernel, layout or transformers made, damaged or unfinished conversions, writes a killed
    process left."""
    from specchat import cache_folder  # torch loads here

    delete(cache_folder.prunable(cache_folder.entries()), dry_run)


@cache.command()
@click.option("--answers", is_flag=True, help="Delete the index of your earlier answers too.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask.")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted, and delete nothing.")
def clear(answers, yes, dry_run):
    """Delete everything in the cache folder but the index of your earlier answers (--answers: that
    too). The next start converts, packs and measures again (a minute or two)."""
    from specchat import cache_folder  # torch loads here

    chosen = cache_folder.clearable(cache_folder.entries(), answers)
    if chosen and not (yes or dry_run):
        if sys.stdin is None or not sys.stdin.isatty():
            raise UsageError("specchat cache clear deletes the whole cache: say --yes (stdin is not a terminal)")
        click.confirm(f"Delete {len(chosen)} entries ({cache_folder.human(cache_folder.total(chosen))}) "
                      f"under {cache_folder.cache_dir()}?", abort=True, err=True)
    delete(chosen, dry_run)


def delete(chosen: list, dry_run: bool) -> None:
    """Delete the cache entries `chosen` (`dry_run`: only say which), saying each and the space freed."""
    from specchat import cache_folder

    root = cache_folder.cache_dir()
    if dry_run:
        for entry in chosen:
            click.echo(f"would delete {entry.path.relative_to(root)} ({cache_folder.human(entry.size)})")
        click.echo(f"{cache_folder.human(cache_folder.total(chosen))} in {len(chosen)} entries would be freed")
        return
    done = cache_folder.remove(chosen)
    for entry in done.removed:
        click.echo(f"deleted {entry.path.relative_to(root)} ({cache_folder.human(entry.size)})")
    for entry in done.in_use:
        click.echo(f"left {entry.path.relative_to(root)}: another specchat is making it", err=True)
    click.echo(f"freed {cache_folder.human(done.freed)} in {len(done.removed)} entries")
    for entry, reason in done.failed:
        click.echo(f"could not delete {entry.path.relative_to(root)}: {reason}", err=True)
    if done.failed:
        raise SpecchatError(f"{len(done.failed)} cache entries could not be deleted (see above)")
