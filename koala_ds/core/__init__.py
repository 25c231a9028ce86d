"""The core: schedules as data (`ir`: Action, Placement, Schedule; JSON and torch-CSV I/O),
their validation (`validate`), the cost-free lowered form every timing model reads (`lowered`), and
the plain-Python helpers every layer above shares: one-line errors (`errors`), whole-or-nothing
output files (`outputs`), JSON input limits (`json_input`), a layer partition as the engines'
settings (`layout`) and what this machine allows koala to start (`machine`). No torch here."""
