"""Built-in grammar backends (structured outputs): ``xgrammar``."""

from tokenloom.core.hookspecs import hookimpl


@hookimpl
def register_grammars(register):
    from tokenloom.plugins.grammars.xgrammar_backend import XGrammarBackend

    register("xgrammar", XGrammarBackend, description="JSON, JSON schema, regex, EBNF and choice "
             "constraints compiled by xgrammar (the `xgrammar` package)")
