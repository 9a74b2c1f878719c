"""The `adaspec` command and the operator tools behind it: the top layer, which may import
every other package (`main`: the command line; `serve_config`: a Serve config checked before
it is deployed; `profile`: a k x batch sweep of a live server)."""
