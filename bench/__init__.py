"""kvrag's benchmarks, each a `kvrag bench <what>` subcommand."""
