"""Built-in grammar backends (structured outputs): ``xgrammar`` (the default) and ``llguidance``."""

from tokenloom.core.hookspecs import hookimpl


@hookimpl
def register_grammars(register):
    from tokenloom.plugins.grammars.llguidance_backend import LLGuidanceBackend
    from tokenloom.plugins.grammars.xgrammar_backend import XGrammarBackend

    register("xgrammar", XGrammarBackend, description="JSON, JSON schema, regex, EBNF and choice "
             "constraints compiled by xgrammar (the `xgrammar` package)")
    register("llguidance", LLGuidanceBackend, description="JSON, JSON schema, regex, Lark (or `root ::=` EBNF) "
             "and choice constraints compiled by llguidance (the `llguidance` package)")
