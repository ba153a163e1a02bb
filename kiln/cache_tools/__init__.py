"""See, move and trust cached artifacts: `kiln cache ls | info | verify | explain | prune | export |
import | dump`. Each subcommand's logic is a module here; `commands.py` is the command line."""
