"""The `adaspec` command and the operator tools behind it: the top layer, which may import
every other package. `main`: the top-level parser and the dispatch; one module per command
(`prepare_models`, `distill_draft`, `eval_draft`, `serve`, `status`, `controller`, `profile`,
`simulate`, `policy`, `bench`, `sweep`), each with `add_parser(subparsers)` and
`run(args) -> exit status`; `arguments`: the list flags and flag groups they share;
`serve_config`: a Serve config checked before it is deployed; `profile` also holds the
k x batch sweep of a live server."""
