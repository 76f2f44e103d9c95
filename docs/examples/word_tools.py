"""An MCP server with one tool, `spell`; each environment host runs it over stdio (env.mcp_servers)."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("words", log_level="ERROR")


@server.tool()
def spell(word: str) -> str:
    """Spells a word letter by letter.

    Args:
        word: The word to spell.
    """
    return " ".join(word)


if __name__ == "__main__":
    server.run("stdio")
