"""Importing the real prompt sets: source rows -> the project's prompts, selected before a cent is spent.

`schemas` converts each public schema (glaive, instruction columns, `messages` lists, ShareGPT
`conversations`) to messages + tools without the final assistant answer; `selection` holds the
normalisation, de-duplication key, seeded sampling order and filters; `importer` streams a
source through them and keeps a bounded, reproducible sample.

Part of the `raw_prompts` stage: may import it, `common` and `eagle3_resources`.
"""
