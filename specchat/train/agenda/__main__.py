"""`python -m specchat.train.agenda`: the agenda's commands (pack, device, collect)."""

from specchat.train.agenda import cli

cli()
