"""What an audit leaves behind: the private reconstruction store and the HTML report."""
