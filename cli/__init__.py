"""The `tokenloom` command: ``main.py`` builds the parser and dispatches; each sub-command
group has a module (serve, router, plan, quantize, eval, train-medusa; `bench` lives in
``tokenloom.bench``); ``args.py`` holds the engine flags they share."""
